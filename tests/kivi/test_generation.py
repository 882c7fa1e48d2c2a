"""KiviCache inside stock transformers models: tiny random models of real head layouts, then the real SmolLM2."""

import pytest
import torch
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from kivi import KiviCache, KiviConfig, KiviConfigError, enable_kivi

HEAD_LAYOUTS = {
    # name: (model class, config class, heads, kv heads, head_dim)
    "smollm2-gqa": (LlamaForCausalLM, LlamaConfig, 9, 3, 64),
    "qwen2-gqa": (Qwen2ForCausalLM, Qwen2Config, 12, 2, 128),
    "llama-mha": (LlamaForCausalLM, LlamaConfig, 4, 4, 32),
    "mqa": (LlamaForCausalLM, LlamaConfig, 4, 1, 64),
}


def tiny_model(layout: str, dtype=torch.float32, layers=2):
    model_cls, config_cls, heads, kv_heads, head_dim = HEAD_LAYOUTS[layout]
    config = config_cls(
        vocab_size=512, hidden_size=heads * head_dim, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=8192, initializer_range=0.2,  # peaky logits: no near-ties in greedy decoding
    )
    torch.manual_seed(0)
    return model_cls(config).to(dtype).eval()


def _greedy(model, ids, cache, new_tokens, mask=None):
    out = model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                         past_key_values=cache, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_sixteen_bit_kivi_gives_exactly_the_tokens_of_dynamic_cache(layout):
    model = tiny_model(layout)
    ids = torch.randint(1, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = _greedy(model, ids, DynamicCache(config=model.config), 30)
    enable_kivi(model)
    got = _greedy(model, ids, KiviCache(model.config, KiviConfig(k_bits=16, v_bits=16)), 30)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("layout", ["smollm2-gqa", "qwen2-gqa", "llama-mha"])
def test_a_padded_batch_of_three_prompts_equals_the_three_runs_alone(layout):
    model = enable_kivi(tiny_model(layout))
    config = KiviConfig(group_size=32, residual_length=32)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 512, (n,), generator=gen) for n in (70, 45, 101)]
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(3, longest, dtype=torch.long)
    mask = torch.zeros(3, longest, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):], mask[b, longest - len(p):] = p, 1
    batched = _greedy(model, ids, KiviCache(model.config, config), 40, mask)
    for b, p in enumerate(prompts):
        alone = _greedy(model, p[None], KiviCache(model.config, config), 40)
        assert torch.equal(batched[b], alone[0]), f"prompt {b} differs"


def test_quantization_changes_the_cache_but_the_model_still_generates():
    model = enable_kivi(tiny_model("smollm2-gqa"))
    ids = torch.randint(1, 512, (1, 300), generator=torch.Generator().manual_seed(3))
    cache = KiviCache(model.config, KiviConfig())
    out = _greedy(model, ids, cache, 10)
    layer = cache.layers[0]
    assert (layer.key_stream.n_quant[0], layer.key_stream.n_resid[0]) == (256, 53)  # 309 tokens held
    assert (layer.value_stream.n_quant[0], layer.value_stream.n_resid[0]) == (181, 128)
    assert out.shape == (1, 10)


def test_a_kivi_cache_without_enable_kivi_fails_with_a_clear_message():
    model = tiny_model("smollm2-gqa")
    with pytest.raises(RuntimeError, match="enable_kivi"):
        _greedy(model, torch.randint(1, 512, (1, 20)), KiviCache(model.config, KiviConfig()), 3)


def test_a_sliding_window_is_kept_by_the_cache_as_the_model_applies_it():
    """Mistral's config slides every layer when ``sliding_window`` is set: past the window, a cache attending over
    every stored token gives other tokens than the model's own attention (shown here). KiviCache keeps each sliding
    layer's window in the model dtype, so on a model whose every layer slides even 2-bit KIVI gives fp16's tokens."""
    config = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16, initializer_range=0.2)
    torch.manual_seed(0)
    model = enable_kivi(MistralForCausalLM(config).eval())
    ids = torch.randint(1, 512, (1, 40))
    windowed = _greedy(model, ids, DynamicCache(config=config), 20)
    model.config.sliding_window = None
    unwindowed = _greedy(model, ids, DynamicCache(config=model.config), 20)
    assert not torch.equal(windowed, unwindowed)
    model.config.sliding_window = 16
    cache = KiviCache(model.config, KiviConfig(group_size=16, residual_length=16))
    assert torch.equal(_greedy(model, ids, cache, 20), windowed)
    assert cache.kv_bytes() == cache.fp16_kv_bytes() * 2  # float32 windows of 15 tokens: nothing quantized


def test_model_dependent_values_are_checked_when_the_cache_is_made():
    model = tiny_model("llama-mha")  # head_dim 32
    with pytest.raises(KiviConfigError, match="group_size=64 must divide the model's head_dim=32"):
        KiviCache(model.config, KiviConfig(group_size=64, residual_length=128))
    with pytest.raises(KiviConfigError, match=r"layer_overrides\[5\]: the model has 2 layers"):
        KiviCache(model.config, KiviConfig(layer_overrides={5: {"k_bits": 4}}))


def test_kv_bytes_at_4096_tokens_is_the_packed_arithmetic_and_under_022_of_fp16():
    model = enable_kivi(tiny_model("smollm2-gqa", dtype=torch.bfloat16, layers=1))
    cache = KiviCache(model.config, KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=128))
    with torch.inference_mode():
        model(torch.randint(1, 512, (1, 4096)), past_key_values=cache, use_cache=True)
    elems = 3 * 64  # kv heads × head_dim, per token
    keys_q, values_q = 4096, 4096 - 128  # keys: floor(T/R)*R quantized; values: all but the newest R

    def packed(n):  # 2-bit codes + bf16 scales and zeros
        return n * elems * 2 // 8 + 2 * (n // 32) * elems * 2

    expected = packed(keys_q) + packed(values_q) + 128 * elems * 2
    assert cache.kv_bytes() == expected
    assert cache.fp16_kv_bytes() == 2 * 4096 * elems * 2
    assert cache.kv_bytes() / cache.fp16_kv_bytes() <= 0.22


@pytest.mark.slow
def test_on_smollm2_sixteen_bit_kivi_matches_dynamic_cache_for_64_tokens(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("Write a short story about a lighthouse keeper.", return_tensors="pt").input_ids
    expected = _greedy(model, ids, DynamicCache(config=model.config), 64)
    enable_kivi(model)
    assert torch.equal(_greedy(model, ids, KiviCache(model.config, KiviConfig(k_bits=16, v_bits=16)), 64), expected)


@pytest.mark.slow
def test_on_smollm2_a_padded_batch_equals_each_prompt_alone(smollm2, data_dir):
    model, tokenizer = smollm2
    enable_kivi(model)
    essay = sorted((data_dir / "niah" / "PaulGrahamEssays").glob("*.txt"))[0].read_text()
    prompts = [essay[:600] + "\nSummary:", essay[:1400] + "\nSummary:", "The capital of France is"]
    config = KiviConfig(residual_length=32)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    batched = _greedy(model, batch.input_ids, KiviCache(model.config, config), 24, batch.attention_mask)
    for b, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert torch.equal(batched[b], _greedy(model, ids, KiviCache(model.config, config), 24)[0]), prompt[:30]
