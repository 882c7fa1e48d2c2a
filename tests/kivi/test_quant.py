import pytest
import torch

from kivi.quant import GROUP_DIM, allocate, codes_per_word, dequantize, pack, packed_shapes, quantize, unpack


def _with_outlier_channels(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 20  # key-like outlier channels (the reason keys are grouped per channel)
    x[..., -1] += 8
    return x.to(dtype)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_pack_then_unpack_returns_the_codes_exactly(bits, axis):
    dim = GROUP_DIM[axis]
    codes = torch.randint(0, 2**bits, (2, 3, 64, 64))
    codes[0, 0, 0, 0] = 2**bits - 1  # top code in the top slot sets the int32 sign bit
    words = pack(codes, bits, dim)
    assert words.dtype == torch.int32
    assert words.shape[dim] == 64 // codes_per_word(bits)
    assert torch.equal(unpack(words, bits, dim), codes)


def test_the_packed_layout_is_the_documented_one():
    # keys (grouped along tokens): word (w, d) holds tokens w*16 .. w*16+15 of channel d, token j in bits 2j..2j+1
    codes = torch.randint(0, 4, (1, 1, 32, 8))
    words = pack(codes, 2, GROUP_DIM["channel"])
    assert words.shape == (1, 1, 2, 8)
    w, d, j = 1, 5, 7
    assert (int(words[0, 0, w, d]) >> (2 * j)) & 3 == int(codes[0, 0, w * 16 + j, d])
    # values (grouped along channels): word (t, w) holds channels w*16 .. w*16+15 of token t
    codes = torch.randint(0, 4, (1, 1, 4, 32))
    words = pack(codes, 2, GROUP_DIM["token"])
    assert words.shape == (1, 1, 4, 2)
    assert (int(words[0, 0, 3, 1]) >> (2 * 9)) & 3 == int(codes[0, 0, 3, 16 + 9])


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_buffers_are_allocated_in_the_shapes_quantize_writes(bits, axis):
    # The one statement of the layout's shapes that caches and kernels allocate from.
    x = _with_outlier_channels((2, 3, 64, 96), torch.float16)
    q = quantize(x, bits, 32, GROUP_DIM[axis])
    assert packed_shapes(tuple(x.shape), bits, 32, axis) == (tuple(q.codes.shape), tuple(q.scale.shape))
    buffers = allocate(tuple(x.shape), bits, 32, axis, x.dtype, x.device)
    assert [(t.shape, t.dtype) for t in buffers] == [(t.shape, t.dtype) for t in q]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_round_trip_error_is_at_most_half_a_step(bits, axis):
    dim, group = GROUP_DIM[axis], 32
    x = _with_outlier_channels((2, 2, 64, 64))
    q = quantize(x, bits, group, dim)
    err = (dequantize(q, bits, group, dim) - x).abs()
    step = q.scale.float().repeat_interleave(group, dim=dim)
    assert bool((err <= step / 2 + 1e-5).all()), f"worst excess {(err - step / 2).max():.3g}"
    assert err.mean() > 0  # really quantized


def test_more_bits_give_smaller_errors():
    x = _with_outlier_channels((1, 2, 128, 64))
    errors = [(dequantize(quantize(x, b, 32, -2), b, 32, -2) - x).pow(2).mean().item() for b in (2, 4, 8)]
    assert errors[0] > 10 * errors[1] > 100 * errors[2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scales_and_zeros_are_stored_in_the_model_dtype_and_bound_the_error(dtype):
    x = _with_outlier_channels((1, 2, 64, 64), dtype)
    q = quantize(x, 2, 32, -2)
    assert q.scale.dtype == q.zero.dtype == dtype
    err = (dequantize(q, 2, 32, -2) - x.float()).abs()
    step = q.scale.float().repeat_interleave(32, dim=-2)
    # codes come from the rounded zero, so the bound widens by that rounding (relative eps of |zero|)
    slack = q.zero.float().abs().repeat_interleave(32, dim=-2) * torch.finfo(dtype).eps
    assert bool((err <= step / 2 + slack + 1e-3).all())


def test_a_constant_group_does_not_divide_by_zero_and_is_exact():
    x = torch.full((1, 1, 32, 64), 0.75)
    q = quantize(x, 2, 32, -2)
    assert torch.equal(q.scale, torch.zeros_like(q.scale))
    assert torch.equal(dequantize(q, 2, 32, -2), x)
    assert not torch.isnan(dequantize(q, 2, 32, -2)).any()


def test_keys_are_grouped_per_channel_and_values_per_token():
    x = _with_outlier_channels((1, 1, 64, 64))
    assert quantize(x, 2, 32, GROUP_DIM["channel"]).scale.shape == (1, 1, 2, 64)  # one per 32 tokens × channel
    assert quantize(x, 2, 32, GROUP_DIM["token"]).scale.shape == (1, 1, 64, 2)  # one per token × 32 channels
