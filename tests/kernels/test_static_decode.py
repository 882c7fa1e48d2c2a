"""SlotCache decode steps on the kernels (dense decode, KIVI decode over the value ring, the flush kernel)
against the same steps on the kivi/ oracle, from prompts of ragged lengths through several flushes: grouped and
single KV heads, head sizes of 64, 256 and 96 (stored padded to 128 for the kernels), soft-capped logits, and a
sliding-window layer's ring."""

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from kivi.kernels.dense_decode import dense_decode_attention
from kivi.attention import attention_over_cache
from kivi.config import KiviConfig
from kivi.slot_cache import SlotCache
from tools.kernel_data import outlier_kv, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-3
LENGTHS = [61, 30, 95, 64]  # the first key flush comes at a different step for each sequence (64's at the first)
STEPS = 4
CACHES = {
    "fp16": None,
    "kivi-2 G32 R32": KiviConfig(group_size=32, residual_length=32),
    "k4 v2 G16 R0": KiviConfig(k_bits=4, v_bits=2, group_size=16, residual_length=0),
}
HEADS = {"MHA D64": (2, 2, 64), "GQA-3 D64 (SmolLM2)": (6, 2, 64), "MQA D256 (Gemma 3)": (4, 1, 256),
         "D96 (Phi-3)": (2, 2, 96)}


def twin_caches(kivi, heads, gen, window=None):
    """Two SlotCaches holding the same prompts: one on the kernels, one on the oracle."""
    q_heads, kv_heads, dim = heads
    config = MistralConfig(hidden_size=q_heads * dim, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                           head_dim=dim, num_hidden_layers=1, intermediate_size=16, vocab_size=16, sliding_window=window)
    # Right-padded prompts; the padding is random, so reading it would show.
    keys, values = outlier_kv(len(LENGTHS), kv_heads, max(LENGTHS), dim, torch.float16, DEVICE, gen)
    lengths = torch.tensor(LENGTHS)
    caches = []
    for use_kernels in (True, False):
        cache = SlotCache(config, len(LENGTHS), max(LENGTHS) + STEPS, torch.float16, DEVICE, kivi, use_kernels)
        cache.load(torch.arange(len(LENGTHS)), [(keys, values)], lengths)
        caches.append(cache)
    return caches


def assert_steps_agree(kernels, oracle, heads, gen, softcap=None):
    q_heads, kv_heads, dim = heads
    for _ in range(STEPS):
        query = torch.randn(len(LENGTHS), q_heads, 1, dim, generator=gen, device=DEVICE).half()
        key, value = outlier_kv(len(LENGTHS), kv_heads, 1, dim, torch.float16, DEVICE, gen)
        outs = []
        for cache in (kernels, oracle):
            outs.append(cache.layers[0].attend(query, key, value, dim**-0.5, softcap))
            cache.advance()
        assert outs[0].shape == query.shape and not outs[0].isnan().any()
        assert relative_error(*outs) <= TOLERANCE
    assert torch.equal(kernels.positions, oracle.positions)
    # The flush kernel wrote what the oracle's flush wrote: codes, scales, zeros, residuals (padded channels: 0).
    for got, want in zip(kernels.layers[0]._buffers(), oracle.layers[0]._buffers(), strict=True):
        assert torch.equal(got[..., : want.shape[-1]], want) and not got[..., want.shape[-1]:].any()


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("name", list(CACHES), ids=list(CACHES))
def test_static_steps_on_kernels_match_the_oracle(name, heads, num_splits):
    gen = torch.Generator(device=DEVICE).manual_seed(len(name) * 7 + len(heads))
    kernels, oracle = twin_caches(CACHES[name], HEADS[heads], gen)
    kernels.layers[0].num_splits = num_splits
    assert_steps_agree(kernels, oracle, HEADS[heads], gen)


def test_a_key_block_of_two_groups_flushes_as_on_the_oracle():
    # R = 64: the block the 61-token prompt fills at its third step is two key groups, one flush program each.
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    kernels, oracle = twin_caches(KiviConfig(group_size=32, residual_length=64), HEADS["GQA-3 D64 (SmolLM2)"], gen)
    assert_steps_agree(kernels, oracle, HEADS["GQA-3 D64 (SmolLM2)"], gen)


@pytest.mark.parametrize("name", ["fp16", "kivi-2 G32 R32"])
def test_soft_capped_steps_on_kernels_match_the_oracle(name):
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    heads = HEADS["GQA-3 D64 (SmolLM2)"]
    kernels, oracle = twin_caches(CACHES[name], heads, gen)
    kernels.layers[0].num_splits = 2
    assert_steps_agree(kernels, oracle, heads, gen, softcap=2.0)  # logits of about +-10 (outliers): the cap binds


@pytest.mark.parametrize("num_splits", [1, 2])
def test_a_sliding_layers_ring_on_kernels_matches_the_oracle(num_splits):
    """Window 40: the 61- and 95-token prompts load their last 39 tokens into the ring, the 30-token one all."""
    gen = torch.Generator(device=DEVICE).manual_seed(num_splits)
    heads = HEADS["GQA-3 D64 (SmolLM2)"]
    kernels, oracle = twin_caches(CACHES["kivi-2 G32 R32"], heads, gen, window=40)
    assert kernels.layers[0].keys.shape[2] == 40
    kernels.layers[0].num_splits = num_splits
    assert_steps_agree(kernels, oracle, heads, gen)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_dense_decode_reads_only_each_sequences_tokens(num_splits):
    gen = torch.Generator(device=DEVICE).manual_seed(num_splits)
    lengths = torch.tensor([200, 1, 77], dtype=torch.int32, device=DEVICE)
    keys, values = outlier_kv(3, 2, 256, 64, torch.float16, DEVICE, gen)
    query = torch.randn(3, 4, 1, 64, generator=gen, device=DEVICE).half()
    out = torch.full(query.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    dense_decode_attention(query, keys, values, lengths, 0.125, num_splits, out=out)
    ref = attention_over_cache(query.float(), keys.float(), values.float(), lengths, 0.125)
    assert relative_error(out, ref) <= TOLERANCE


def test_static_cache_rejects_what_it_cannot_hold():
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                         num_hidden_layers=2, intermediate_size=16, vocab_size=16)
    with pytest.raises(ValueError, match="sink_tokens=4.*set sink_tokens: 0"):
        SlotCache(config, 1, 64, torch.float16, DEVICE, KiviConfig(sink_tokens=4))
    with pytest.raises(ValueError, match=r"k_bits/v_bits=16.*layer_overrides\[1\]"):
        SlotCache(config, 1, 64, torch.float16, DEVICE, KiviConfig(layer_overrides={1: {"k_bits": 16}}))
