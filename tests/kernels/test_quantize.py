"""The Triton quantize + pack kernel against the oracle kivi.quant.quantize."""

import pytest
import torch

from kivi.kernels.quantize import quantize, quantize_into
from kivi.quant import GROUP_DIM, Quantized, dequantize, packed_shapes, unpack
from kivi.quant import quantize as reference_quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def outlier_tensor(shape, dtype, seed):
    """Random x with outlier channels, a loud token and one constant group (scale 0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x[..., 3] = x[..., 3] * 20 + 5  # outlier channel
    x[:, :, shape[2] // 2] *= 10  # loud token
    x[0, 0, :16, :16] = 0.75  # constant in every grouping
    return x.to(dtype).to(DEVICE)


def assert_matches_oracle(got: Quantized, x: torch.Tensor, bits: int, group_size: int, axis: str):
    """Scales and zeros bit-exact; codes equal except, at most, rare off-by-one round-half ties."""
    dim = GROUP_DIM[axis]
    ref = reference_quantize(x, bits, group_size, dim)
    assert torch.equal(got.scale, ref.scale), "scales differ from kivi.quant"
    assert torch.equal(got.zero, ref.zero), "zeros differ from kivi.quant"
    codes, ref_codes = unpack(got.codes, bits, dim), unpack(ref.codes, bits, dim)
    diff = (codes - ref_codes).abs()
    assert diff.max() <= 1, f"codes differ by up to {diff.max().item()}"
    assert (diff > 0).float().mean() <= 1e-4, f"{(diff > 0).sum().item()} of {diff.numel()} codes differ"
    # Whatever ties did, every element is reconstructed within half a step of its group, plus what rounding
    # the scale to the model dtype (unit roundoff u) shifts the top code: (2^b - 1) * step * u.
    step = got.scale.float().repeat_interleave(group_size, dim=dim)
    u = torch.finfo(x.dtype).eps
    err = (dequantize(got, bits, group_size, dim) - x.float()).abs()
    bound = step * (0.5 + (2**bits - 1) * u) * (1 + 1e-3) + 1e-6
    assert (err <= bound).all(), f"dequantization error {(err - bound).max().item():.3g} over the bound"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(
    "axis, shape, group_size",
    [
        ("channel", (2, 3, 96, 64), 32),  # keys: T a multiple of G
        ("channel", (1, 2, 48, 96), 16),  # head_dim not a power of two
        ("token", (2, 3, 37, 64), 32),  # values: any T
        ("token", (1, 2, 54, 96), 32),  # 3 channel groups: padded to 4 inside the kernel
    ],
)
def test_quantize_matches_kivi_quant(axis, shape, group_size, bits, dtype):
    x = outlier_tensor(shape, dtype, seed=bits + shape[2])
    codes_shape, stat_shape = packed_shapes(shape, bits, group_size, axis)
    poisoned = Quantized(
        torch.randint(-(2**31), 2**31 - 1, codes_shape, dtype=torch.int32, device=DEVICE),
        torch.full(stat_shape, float("nan"), dtype=dtype, device=DEVICE),
        torch.full(stat_shape, float("nan"), dtype=dtype, device=DEVICE),
    )
    got = quantize_into(x, poisoned, bits, group_size, axis)
    assert not got.scale.isnan().any() and not got.zero.isnan().any(), "statistics left unwritten"
    assert_matches_oracle(got, x, bits, group_size, axis)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_quantize_reads_strided_input_like_the_models_key_states(axis):
    # transformers hands keys as [B, T, H, D].transpose(1, 2): not contiguous along T.
    x = outlier_tensor((2, 64, 3, 64), torch.float16, seed=7).transpose(1, 2)
    assert not x.is_contiguous()
    assert_matches_oracle(quantize(x, 2, 32, axis), x, 2, 32, axis)


@pytest.mark.parametrize("block_t", [32, 64])
def test_quantize_block_size_does_not_change_the_result(block_t):
    x = outlier_tensor((1, 2, 128, 64), torch.float16, seed=3)
    code_shape, stat_shape = packed_shapes(tuple(x.shape), 2, 32, "channel")
    out = Quantized(*(torch.empty(s, dtype=t, device=DEVICE) for s, t in ((code_shape, torch.int32), (stat_shape, x.dtype), (stat_shape, x.dtype))))
    got = quantize_into(x, out, 2, 32, "channel", block_t=block_t)
    assert all(torch.equal(a, b) for a, b in zip(got, quantize(x, 2, 32, "channel")))


def test_quantize_rejects_a_token_count_that_splits_a_key_group():
    with pytest.raises(ValueError, match="T % group_size"):
        quantize(torch.randn(1, 1, 40, 64, device=DEVICE).half(), 2, 32, "channel")
