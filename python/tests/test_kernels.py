"""laminar.cast on torch tensors and NumPy arrays given through DLPack, against torch's and NumPy's
own conversions (all round to nearest even, so the bits must match)."""

import random

import numpy as np
import pytest
import torch

import laminar


def values(rng, n):
    # Normal numbers, subnormals, ties for rounding, zeros, infinities and values past f16's range.
    special = [0.0, -0.0, 1e-40, -1e-45, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0, 65520.0, 1e6, float("inf"),
               float("-inf")]
    return torch.tensor([rng.gauss(0, 10) for _ in range(n)] + special, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_f32_to_half_matches_torch_in_place(rng, dtype):
    src = values(rng, 4096)
    dst = torch.full(src.shape, 7.0, dtype=dtype)
    address = dst.data_ptr()
    laminar.cast(src, dst)
    assert dst.data_ptr() == address  # written in place
    assert torch.equal(dst.view(torch.int16), src.to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_to_f32_and_between_halves(rng, dtype):
    src = values(rng, 989).to(dtype).reshape(25, 40)
    dst = torch.empty(src.shape, dtype=torch.float32)
    laminar.cast(src, dst)
    assert torch.equal(dst, src.to(torch.float32))
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    out = torch.empty(src.shape, dtype=other)
    laminar.cast(src, out)
    assert torch.equal(out.view(torch.int16), src.to(torch.float32).to(other).view(torch.int16))


def test_numpy_arrays_and_nan(rng):
    src = values(rng, 500).numpy()
    src[3] = np.nan
    dst = np.zeros(src.shape, np.float16)
    laminar.cast(src, dst)
    with np.errstate(over="ignore"):  # 1e6 and 65520 become inf, as they should
        expected = src.astype(np.float16)
    assert np.isnan(dst[3])
    keep = ~np.isnan(src)
    np.testing.assert_array_equal(dst[keep].view(np.int16), expected[keep].view(np.int16))
    laminar.cast(np.zeros(0, np.float32), np.zeros(0, np.float16))


@pytest.mark.parametrize("src,dst,fragment", [
    (torch.zeros(4), torch.zeros(5, dtype=torch.float16), "shape"),
    (torch.zeros(4), torch.zeros(4, dtype=torch.int32), "dtype i32"),
    (torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.float16), "dtype i64"),
    (torch.zeros(4), torch.zeros(8, dtype=torch.float16)[::2], "dense"),
    (torch.zeros(4, 2).t(), torch.zeros(2, 4, dtype=torch.float16), "dense"),
    ([0.0] * 4, torch.zeros(4, dtype=torch.float16), "__dlpack__"),
    (torch.zeros(4, requires_grad=True), torch.zeros(4, dtype=torch.float16), "require gradient"),
    (torch.zeros(4, dtype=torch.complex64), torch.zeros(4, dtype=torch.float16), "src"),
])
def test_bad_tensors_raise_invalid_argument(src, dst, fragment):
    before = dst.clone() if isinstance(dst, torch.Tensor) else None
    with pytest.raises(laminar.InvalidArgumentError) as info:
        laminar.cast(src, dst)
    assert fragment in str(info.value), str(info.value)
    assert "At:" not in str(info.value)  # no Python traceback in the message
    if before is not None:
        assert torch.equal(dst, before)


def test_overlapping_tensors_are_refused():
    buf = torch.zeros(8)
    with pytest.raises(laminar.InvalidArgumentError, match="overlap"):
        laminar.cast(buf, buf)
    raw = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(laminar.InvalidArgumentError, match="overlap"):
        laminar.cast(raw[:4], raw[2:6])


def test_token_logprob_against_torch(rng):
    torch.manual_seed(rng.randrange(2**31))
    logits = torch.randn(6, 1000) * 4
    tokens = torch.tensor([rng.randrange(1000) for _ in range(6)], dtype=torch.int64)
    out = torch.empty(6)
    laminar.token_logprob(logits, tokens, out)
    expected = torch.log_softmax(logits.double(), dim=1)[torch.arange(6), tokens].float()
    # Weights are 40-bit fixed point (sampling.h): a few 1e-6 from the float64 log-softmax.
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    laminar.token_logprob(logits.to(torch.bfloat16), tokens.int(), out, cpu_threads=2)
    expected = torch.log_softmax(logits.to(torch.bfloat16).double(), dim=1)[torch.arange(6), tokens].float()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    with pytest.raises(laminar.InvalidArgumentError, match=r"token\[2\] = 1000"):
        laminar.token_logprob(logits, torch.tensor([0, 1, 1000, 3, 4, 5]), out)
    with pytest.raises(laminar.InvalidArgumentError, match="logprob"):
        laminar.token_logprob(logits, tokens, torch.empty(6, dtype=torch.float64))


def test_sample_greedy_and_logprobs_against_torch(rng):
    torch.manual_seed(rng.randrange(2**31))
    batch, vocab = 8, 5000
    logits = torch.randn(batch, vocab)
    token = torch.empty(batch, dtype=torch.int32)
    raw = torch.empty(batch)
    processed = torch.empty(batch)
    kept = torch.empty(batch)
    seed = torch.arange(batch, dtype=torch.int64)
    position = torch.zeros(batch, dtype=torch.int64)
    laminar.sample(logits, seed, position, token, temperature=torch.zeros(batch), raw_logprob=raw,
                   processed_logprob=processed, kept_mass=kept)
    assert torch.equal(token.long(), logits.argmax(dim=1))
    assert torch.equal(processed, torch.zeros(batch)) and torch.equal(kept, torch.ones(batch))
    scored = torch.empty(batch)
    laminar.token_logprob(logits, token, scored)
    assert torch.equal(raw, scored)  # bit-identical by design
    laminar.sample(logits, seed, position, token, top_k=torch.ones(batch, dtype=torch.int32))
    assert torch.equal(token.long(), logits.argmax(dim=1))


def test_sample_follows_the_distribution_and_is_batch_invariant(rng):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    logits = probs.log().expand(n, 4).contiguous()
    seed = torch.full((n,), rng.randrange(2**62), dtype=torch.int64)
    position = torch.arange(n, dtype=torch.int64)
    token = torch.empty(n, dtype=torch.int32)
    laminar.sample(logits, seed, position, token)
    freq = torch.bincount(token.long(), minlength=4).float() / n
    # Binomial standard deviation at n = 20000 is at most 0.0035; 0.015 is over four of them.
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    # Row 17 sampled alone, with the same seed and position, gives the same token.
    alone = torch.empty(1, dtype=torch.int32)
    laminar.sample(logits[17:18], seed[17:18], position[17:18], alone)
    assert alone.item() == token[17].item()
    # top_p 0.5 keeps the two most likely tokens (0.4 + 0.3 >= 0.5 needs both).
    laminar.sample(logits, seed, position, token, top_p=torch.full((n,), 0.5))
    assert set(token.unique().tolist()) == {2, 3}


@pytest.mark.parametrize("change,fragment", [
    (dict(seed=torch.zeros(4, dtype=torch.int32)), "seed"),
    (dict(position=torch.zeros(3, dtype=torch.int64)), "position"),
    (dict(token=torch.zeros(8, dtype=torch.int32)[::2]), "token"),
    (dict(logits=torch.zeros(4, 10, dtype=torch.float64)), "logits"),
    (dict(temperature=torch.tensor([1.0, -1.0, 1.0, 1.0])), "temperature[1] = -1"),
    (dict(top_p=torch.tensor([1.0, 1.0, 1.5, 1.0])), "top_p[2] = 1.5"),
])
def test_sample_bad_input_writes_nothing(change, fragment):
    args = dict(logits=torch.zeros(4, 10), seed=torch.zeros(4, dtype=torch.int64),
                position=torch.zeros(4, dtype=torch.int64), token=torch.full((4,), 7, dtype=torch.int32))
    options = {k: change.pop(k) for k in list(change) if k in ("temperature", "top_p")}
    args.update(change)
    before = args["token"].clone()
    with pytest.raises(laminar.InvalidArgumentError) as info:
        laminar.sample(args["logits"], args["seed"], args["position"], args["token"], **options)
    assert fragment in str(info.value), str(info.value)
    assert torch.equal(args["token"], before)


def paged(rng, dtype, lengths, page_size=16, kv_heads=2, group=2, head_dim=64):
    """Random pages holding `lengths` tokens per sequence, in shuffled pages."""
    pages_per = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per) + 3
    order = list(range(num_pages))
    rng.shuffle(order)
    k = torch.randn(num_pages, page_size, kv_heads, head_dim).to(dtype)
    v = torch.randn(num_pages, page_size, kv_heads, head_dim).to(dtype)
    indptr = torch.tensor([0] + list(np.cumsum(pages_per)), dtype=torch.int32)
    indices = torch.tensor(order[:sum(pages_per)], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lengths, pages_per)], dtype=torch.int32)
    q = torch.randn(len(lengths), kv_heads * group, head_dim).to(dtype)
    return q, k, v, indptr, indices, last


def attention_reference(q, k, v, indptr, indices, lengths, group):
    """Plain torch attention in float64 over each sequence's tokens gathered from its pages."""
    out, lse = [], []
    for b, n in enumerate(lengths):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        keys = k[pages].double().flatten(0, 1)[:n]  # [n, kv_heads, head_dim]
        values = v[pages].double().flatten(0, 1)[:n]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), keys) / q.shape[-1] ** 0.5
        out.append(torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=1), values))
        lse.append(torch.logsumexp(scores, dim=1))
    return torch.stack(out), torch.stack(lse)


@pytest.mark.parametrize("dtype,atol", [
    (torch.float32, 1e-5),   # float32 accumulation in the kernel's own order: a few ulps of O(1) values
    (torch.bfloat16, 2e-2),  # the output is rounded to bfloat16 (8 bits of mantissa): 2^-7 of O(1) values
])
def test_paged_decode_against_torch(rng, dtype, atol):
    lengths = [1, 17, 300, 64]
    q, k, v, indptr, indices, last = paged(rng, dtype, lengths)
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(q.shape[0], q.shape[1])
    laminar.paged_decode(q, out, k, v, indptr, indices, last.long(), lse=lse, cpu_threads=2)
    expected, expected_lse = attention_reference(q, k, v, indptr, indices, lengths, group=2)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=0)


def test_paged_decode_bad_input(rng):
    q, k, v, indptr, indices, last = paged(rng, torch.float32, [5, 9])
    out = torch.zeros_like(q)
    with pytest.raises(laminar.InvalidArgumentError, match="out"):
        laminar.paged_decode(q, out.half(), k, v, indptr, indices, last)
    with pytest.raises(laminar.InvalidArgumentError, match="v_pages"):
        laminar.paged_decode(q, out, k, v[:, :8], indptr, indices, last)
    with pytest.raises(laminar.InvalidArgumentError, match="q"):
        laminar.paged_decode(q[:, :3], out[:, :3], k, v, indptr, indices, last)
    with pytest.raises(laminar.InvalidArgumentError, match="sm_scale"):
        laminar.paged_decode(q, out, k, v, indptr, indices, last, sm_scale="x")
    assert torch.equal(out, torch.zeros_like(q))


def cpu_calls():
    """Each kernel once on host tensors, as a function taking the call's keywords."""
    logits = torch.randn(4, 100)
    token = torch.zeros(4, dtype=torch.int32)
    seed, position = torch.arange(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    q, k, v, indptr, indices, last = paged(random.Random(0), torch.float32, [5, 9])
    return [
        lambda **kw: laminar.cast(logits, torch.empty(4, 100, dtype=torch.float16), **kw),
        lambda **kw: laminar.sample(logits, seed, position, token, **kw),
        lambda **kw: laminar.token_logprob(logits, token, torch.empty(4), **kw),
        lambda **kw: laminar.paged_decode(q, torch.empty_like(q), k, v, indptr, indices, last, **kw),
    ]


@pytest.mark.parametrize("bad", [-1, 2**64, "0", 1.0, True])
def test_stream_must_be_a_non_negative_int(bad):
    for call in cpu_calls():
        with pytest.raises(laminar.InvalidArgumentError, match="stream"):
            call(stream=bad)


def test_stream_is_refused_for_host_tensors():
    for call in cpu_calls():
        call(stream=None)
        with pytest.raises(laminar.InvalidArgumentError, match="stream applies to CUDA tensors only"):
            call(stream=0)


def late_on(stream, make, like):
    """A tensor `make()` fills on `stream` after a sleep: a kernel not ordered after the stream's
    work reads the NaNs it starts with."""
    out = torch.full_like(like, float("nan"))
    stream.wait_stream(torch.cuda.current_stream())  # everything made so far, the NaNs included
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
        out.copy_(make())
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_run_on_torchs_current_stream(rng):
    torch.manual_seed(rng.randrange(2**31))
    side = torch.cuda.Stream()
    source = torch.randn(64, 32000, device="cuda") * 4
    tokens = torch.randint(0, 32000, (64,), device="cuda", dtype=torch.int32)
    rows = torch.arange(64, device="cuda")
    logits = late_on(side, lambda: source, source)
    with torch.cuda.stream(side):
        out = torch.full((64,), float("nan"), device="cuda")
        laminar.token_logprob(logits, tokens, out)
        expected = torch.log_softmax(source.double(), dim=1)[rows, tokens.long()].float()
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
        half = torch.empty(64, 32000, device="cuda", dtype=torch.float16)
        laminar.cast(logits, half)
        assert torch.equal(half, source.half())
        token = torch.empty(64, dtype=torch.int32, device="cuda")
        laminar.sample(logits, torch.arange(64, device="cuda"), torch.zeros(64, dtype=torch.int64, device="cuda"),
                       token, temperature=torch.zeros(64, device="cuda"))
        assert torch.equal(token.long(), source.argmax(dim=1))

    lengths = [1, 17, 300, 64]
    q, k, v, indptr, indices, last = (t.cuda() for t in paged(rng, torch.float32, lengths))
    late_q = late_on(side, lambda: q, q)
    with torch.cuda.stream(side):
        attn = torch.full_like(q, float("nan"))
        laminar.paged_decode(late_q, attn, k, v, indptr, indices, last, max_kv_len=max(lengths),
                             workspace=torch.empty(16 << 20, dtype=torch.uint8, device="cuda"))
        expected, _ = attention_reference(q, k, v, indptr, indices, lengths, group=2)
        torch.testing.assert_close(attn.double(), expected, atol=1e-5, rtol=0)
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_run_on_the_stream_given(rng):
    torch.manual_seed(rng.randrange(2**31))
    side, given = torch.cuda.Stream(), torch.cuda.Stream()
    source = torch.randn(16, 5000, device="cuda")
    logits = late_on(side, lambda: source, source)
    with torch.cuda.stream(side):
        half = torch.empty(16, 5000, device="cuda", dtype=torch.float16)
        # The export for `given` orders it after side's copy; side then waits for the cast.
        laminar.cast(logits, half, stream=given.cuda_stream)
        side.wait_stream(given)
        assert torch.equal(half, source.half())
    torch.cuda.synchronize()
