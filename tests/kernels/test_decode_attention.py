"""The fused decode attention kernel against the oracle kivi.attention over KVStream.materialize()."""

import pytest
import torch

from kivi.kernels.decode_attention import code_lift, unpack_fields
from kivi.backend import decode_attention, unsupported
from kivi.attention import attention_over_cache
from kivi.config import KiviConfig
from tools.kernel_data import REAL_KV, fill_streams, outlier_kv, reference_decode, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-3  # relative error of the float32 output vs the float32 oracle

CONFIGS = {
    "kivi-2 G32 R32": KiviConfig(group_size=32, residual_length=32),
    "kivi-4 G16 R48 3 sinks": KiviConfig(k_bits=4, v_bits=4, group_size=16, residual_length=48, sink_tokens=3),
    "k2 v4 G32 R64": KiviConfig(k_bits=2, v_bits=4, group_size=32, residual_length=64),
    "kivi-8 G64 R0": KiviConfig(k_bits=8, v_bits=8, group_size=64, residual_length=0),
}
HEADS = {  # (query heads, KV heads, head_dim)
    "MHA D128": (2, 2, 128),
    "GQA-2 D64": (4, 2, 64),
    "GQA-3 D64 (SmolLM2)": (6, 2, 64),
    "MQA-8 D128": (8, 1, 128),
}
LENGTHS = [611, 77, 333]  # ragged, multiples of neither G nor R; the longest has fast tiles at every bit width


def random_case(config, heads, dtype, lengths, seed):
    q_heads, kv_heads, dim = heads
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    keys, values = outlier_kv(len(lengths), kv_heads, max(lengths), dim, dtype, DEVICE, gen)
    query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen, device=DEVICE).to(dtype)
    return (query, *fill_streams(keys, values, lengths, config))


def run_poisoned(query, key_stream, value_stream, num_splits, out_dtype=torch.float32):
    out = torch.full(query.shape, float("nan"), dtype=out_dtype, device=query.device)
    decode_attention(query, key_stream, value_stream, query.shape[-1] ** -0.5, num_splits=num_splits, out=out)
    assert not out.isnan().any(), f"{out.isnan().sum().item()} output elements left unwritten"
    return out


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_decode_matches_oracle_fp16(config, heads, num_splits):
    query, ks, vs = random_case(CONFIGS[config], HEADS[heads], torch.float16, LENGTHS, seed=len(config) + len(heads))
    out = run_poisoned(query, ks, vs, num_splits)
    assert relative_error(out, reference_decode(query, ks, vs, query.shape[-1] ** -0.5)) <= TOLERANCE


@pytest.mark.parametrize("heads", ["MHA D128", "GQA-3 D64 (SmolLM2)"])
@pytest.mark.parametrize("config", ["kivi-2 G32 R32", "kivi-4 G16 R48 3 sinks"])
def test_decode_matches_oracle_bf16(config, heads):
    query, ks, vs = random_case(CONFIGS[config], HEADS[heads], torch.bfloat16, LENGTHS, seed=11)
    out = run_poisoned(query, ks, vs, num_splits=2)
    assert relative_error(out, reference_decode(query, ks, vs, query.shape[-1] ** -0.5)) <= TOLERANCE


def test_decode_rounds_to_the_model_dtype():
    query, ks, vs = random_case(CONFIGS["kivi-2 G32 R32"], HEADS["GQA-2 D64"], torch.bfloat16, LENGTHS, seed=5)
    out = run_poisoned(query, ks, vs, num_splits=2, out_dtype=torch.bfloat16)
    ref = reference_decode(query, ks, vs, query.shape[-1] ** -0.5)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, ref) <= 2 * torch.finfo(torch.bfloat16).eps
    assert decode_attention(query, ks, vs, query.shape[-1] ** -0.5).dtype == torch.bfloat16


@pytest.mark.parametrize("lengths", [[5, 40], [3, 300]], ids=["residual only", "one short, one long"])
def test_decode_with_more_splits_than_tiles(lengths):
    # Splits that own no tile must drop out of the merge, not poison it.
    config = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, sink_tokens=2)
    query, ks, vs = random_case(config, HEADS["GQA-2 D64"], torch.float16, lengths, seed=3)
    out = run_poisoned(query, ks, vs, num_splits=8)
    assert relative_error(out, reference_decode(query, ks, vs, 0.125)) <= TOLERANCE


def test_decode_follows_the_quantized_cache_not_the_exact_one():
    # The comparison above can only pass if the kernel dequantizes: exact attention is far from KIVI's.
    config = KiviConfig(group_size=32, residual_length=32)
    lengths = [200, 150]
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    keys, values = outlier_kv(2, 2, 200, 64, torch.float16, DEVICE, gen)
    query = torch.randn(2, 4, 1, 64, generator=gen, device=DEVICE).half()
    ks, vs = fill_streams(keys, values, lengths, config)
    out = run_poisoned(query, ks, vs, num_splits=2)
    exact = attention_over_cache(query.float(), keys.float(), values.float(), torch.tensor(lengths), 0.125)
    kivi_err = relative_error(out, reference_decode(query, ks, vs, 0.125))
    assert kivi_err * 20 < relative_error(out, exact)


def real_case(config, dtype, lengths):
    """SmolLM2-135M layers as a batch: sequence b holds the first lengths[b] tokens of layer b and attends with
    the query of its last position."""
    data = torch.load(REAL_KV)
    keys, values, queries = (data[name].to(DEVICE, dtype) for name in ("keys", "values", "queries"))
    first_query = keys.shape[2] - queries.shape[2]
    query = torch.stack([queries[b, :, n - 1 - first_query] for b, n in enumerate(lengths)]).unsqueeze(2)
    return (query, *fill_streams(keys, values, lengths, config))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", ["kivi-2 G32 R32", "kivi-4 G16 R48 3 sinks"])
def test_decode_on_real_smollm2_keys_and_values(config, dtype):
    query, ks, vs = real_case(CONFIGS[config], dtype, lengths=[256, 229, 197])
    out = run_poisoned(query, ks, vs, num_splits=2)
    assert relative_error(out, reference_decode(query, ks, vs, 0.125)) <= TOLERANCE


def test_unsupported_layouts_are_reported_and_rejected():
    token_keys = KiviConfig(k_bits=2, v_bits=2, key_axis="token", group_size=32, residual_length=32)
    query, ks, vs = random_case(token_keys, HEADS["GQA-2 D64"], torch.float16, [100, 70], seed=1)
    assert "axis" in unsupported(token_keys, query.shape)
    with pytest.raises(ValueError, match="axis"):
        decode_attention(query, ks, vs, 0.125)
    query, ks, vs = random_case(CONFIGS["kivi-2 G32 R32"], HEADS["GQA-2 D64"], torch.float16, [100, 70], seed=1)
    assert unsupported(CONFIGS["kivi-2 G32 R32"], query.shape) is None
    assert "q_len" in unsupported(CONFIGS["kivi-2 G32 R32"], query.expand(-1, -1, 2, -1).shape)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_fields_give_every_code_exactly_times_its_lift(bits):
    """The PTX unpack (the GPU path, which the interpreter cannot run), emulated on its fields: pair the 16-bit
    halves of two words, shift, mask into the mantissa of 1024, subtract 1024: code j of each word * 2**lift."""
    gen = torch.Generator().manual_seed(bits)
    w1, w2 = (int(w) for w in torch.randint(0, 2**32, (2,), generator=gen, dtype=torch.int64))
    for j in range(32 // bits):
        high, shift, mask = unpack_fields(bits, j)
        paired = (w1 >> 16) | (w2 & 0xFFFF0000) if high else (w1 & 0xFFFF) | ((w2 & 0xFFFF) << 16)
        t = ((paired >> shift) & mask) | 0x64006400
        halves = torch.tensor([t & 0xFFFF, t >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16)
        codes = [(w >> (bits * j)) & ((1 << bits) - 1) for w in (w1, w2)]
        assert (halves.float() - 1024).tolist() == [c * 2 ** code_lift(bits, j) for c in codes], (bits, j)
