"""laminar.cast on torch tensors and NumPy arrays given through DLPack, against torch's and NumPy's
own conversions (all round to nearest even, so the bits must match)."""

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
