"""laminar.PagedKvCache over torch pools: sequences grow, K/V go where token_slot says, and
paged_decode over the cache's page table matches torch attention over the same tokens."""

import pytest
import torch

import laminar


def layout(**overrides):
    fields = dict(num_pages=12, page_size=4, num_kv_heads=2, head_dim=64, dtype="f32", num_layers=2)
    fields.update(overrides)
    return laminar.KvLayout(**fields)


def pools(lay, dtype=torch.float32):
    shape = (lay.num_layers, lay.num_pages, lay.page_size, lay.num_kv_heads, lay.head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def test_layout_fields():
    lay = layout(dtype="bf16")
    assert (lay.num_pages, lay.page_size, lay.num_kv_heads, lay.head_dim, lay.num_layers) == (12, 4, 2, 64, 2)
    assert lay.dtype == "bf16" and lay.page_bytes == 4 * 2 * 64 * 2
    with pytest.raises(laminar.InvalidArgumentError, match="f64"):
        lay.dtype = "f64"


def test_sequences_pages_and_decode_against_torch(rng):
    lay = layout()
    k_pool, v_pool = pools(lay)
    cache = laminar.PagedKvCache(lay, k_pool, v_pool)
    lengths = {7: 9, 8: 1, 9: 14}
    keys, values = {}, {}
    for sid, n in lengths.items():
        cache.add_sequence(sid)
        cache.append_tokens(sid, n)
        assert cache.length(sid) == n and len(cache.pages(sid)) == -(-n // lay.page_size)
        keys[sid] = torch.randn(n, lay.num_kv_heads, lay.head_dim)
        values[sid] = torch.randn(n, lay.num_kv_heads, lay.head_dim)
        for pos in range(n):
            page, offset = cache.token_slot(sid, pos, layer=1)
            k_pool[1, page, offset] = keys[sid][pos]
            v_pool[1, page, offset] = values[sid][pos]
    assert cache.num_sequences == 3 and cache.used_pages == 3 + 1 + 4
    assert cache.free_pages == lay.num_pages - cache.used_pages

    order = [9, 7, 8]
    indptr, indices, last = cache.build_page_table(order)
    assert indptr.tolist()[-1] == len(indices) and last.tolist() == [2, 1, 1]
    group = 2
    q = torch.randn(3, lay.num_kv_heads * group, lay.head_dim)
    out = torch.empty_like(q)
    laminar.paged_decode(q, out, k_pool[1], v_pool[1], torch.from_numpy(indptr), torch.from_numpy(indices),
                         torch.from_numpy(last))
    for row, sid in enumerate(order):
        k = keys[sid].repeat_interleave(group, dim=1).double()
        v = values[sid].repeat_interleave(group, dim=1).double()
        scores = torch.einsum("hd,nhd->hn", q[row].double(), k) / lay.head_dim ** 0.5
        expected = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=1), v)
        # float32 accumulation in the kernel's own order: a few ulps of O(1) values.
        torch.testing.assert_close(out[row].double(), expected, atol=1e-5, rtol=0)

    cache.release(8)
    assert cache.num_sequences == 2
    with pytest.raises(laminar.NotFoundError):
        cache.length(8)


def test_refusals_name_what_is_wrong():
    lay = layout()
    k_pool, v_pool = pools(lay)
    with pytest.raises(laminar.InvalidArgumentError, match="k_pool"):
        laminar.PagedKvCache(lay, k_pool[:, :6], v_pool)
    with pytest.raises(laminar.InvalidArgumentError):
        laminar.PagedKvCache(layout(dtype="bf16"), k_pool, v_pool)  # f32 pools
    with pytest.raises(laminar.InvalidArgumentError, match="k_pool"):
        laminar.PagedKvCache(lay, [0.0], v_pool)
    cache = laminar.PagedKvCache(lay, k_pool, v_pool)
    cache.add_sequence(1)
    with pytest.raises(laminar.AlreadyExistsError):
        cache.add_sequence(1)
    with pytest.raises(laminar.ResourceExhaustedError):
        cache.append_tokens(1, lay.num_pages * lay.page_size + 1)
    assert cache.length(1) == 0 and cache.used_pages == 0  # no change
    with pytest.raises(laminar.NotFoundError):
        cache.append_tokens(2, 1)
    cache.append_tokens(1, 3)
    with pytest.raises(laminar.OutOfRangeError):
        cache.token_slot(1, 3)
    with pytest.raises(IndexError):
        cache.token_slot(1, 0, layer=2)
    with pytest.raises(laminar.InvalidArgumentError):
        cache.build_page_table([1, 1])


def test_reserve_and_adopt():
    lay = layout()
    cache = laminar.PagedKvCache(lay, *pools(lay))
    pages = cache.reserve_pages(3)
    assert len(pages) == 3 and cache.reserved_pages == 3
    cache.adopt_sequence(5, pages, 6)  # two pages hold 6 tokens; the third goes back
    assert cache.pages(5).tolist() == pages[:2] and cache.length(5) == 6 and cache.reserved_pages == 0
    more = cache.reserve_pages(2)
    with pytest.raises(laminar.InvalidArgumentError):
        cache.unreserve_pages([more[0], more[0]])
    cache.unreserve_pages(more)
    assert cache.free_pages == lay.num_pages - 2
