"""The decode engine drives every current decoder through the model's own forward: tiny random models of each
architecture (their transformers config classes) give the greedy tokens of ``generate``, fp16 and KIVI, prompts
longer than a sliding window and decodes that cross it; what no KIVI cache or no decode step can hold is refused
from the config alone (the meta device), before any weights exist.

References: fp16, ``generate`` with a DynamicCache under transformers' eager attention (its reference
implementation, soft-capping included); KIVI, ``generate`` with a KiviCache on the kivi/ oracle.
"""

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from kivi import KiviCache, KiviConfig, KiviConfigError, enable_kivi
from kivi.slot_cache import SlotCache
from pipeline.decode_engine import DecodeEngine, Sequence
from pipeline.decode_step import unsupported
from pipeline.models import meta_model

WINDOW = 8
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHITECTURES = {
    "llama-3.x (llama3 rope)": (LlamaConfig, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral (sliding window)": (MistralConfig, dict(sliding_window=WINDOW)),
    "qwen2 (qkv bias)": (Qwen2Config, {}),
    "qwen3 (q/k norms)": (Qwen3Config, dict(head_dim=32)),
    "gemma2 (soft-capping, sliding + global)": (Gemma2Config, dict(
        head_dim=32, sliding_window=WINDOW, attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
        query_pre_attn_scalar=32, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3 (hybrid, one KV head)": (Gemma3TextConfig, dict(
        head_dim=32, num_key_value_heads=1, sliding_window=WINDOW, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "phi3 (fused qkv)": (Phi3Config, dict(sliding_window=None)),
    "olmo2 (post-norms)": (Olmo2Config, {}),
    "granite (multipliers)": (GraniteConfig, dict(embedding_multiplier=2.0, residual_multiplier=0.5,
                                                  attention_multiplier=0.2, logits_scaling=2.0)),
}
# G = 16, R = 16: prompts of 21 tokens and 12 new ones flush keys and values past the prefill.
CACHES = {"fp16": None, "kivi-2": KiviConfig(group_size=16, residual_length=16),
          "kivi-4": KiviConfig(k_bits=4, v_bits=4, group_size=16, residual_length=16)}
PROMPT_LENGTHS, NEW_TOKENS = (21, 5, 13), 12


def tiny(name: str):
    config_cls, extra = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**SHAPE | extra)).eval()
    model.generation_config.eos_token_id = None  # the engine runs to max_new_tokens here; so must generate
    return model


def reference(model, prompt: list[int], kivi: KiviConfig | None) -> list[int]:
    model.set_attn_implementation("eager" if kivi is None else "kivi")
    ids = torch.tensor([prompt])
    cache = None if kivi is None else KiviCache(model.config, kivi)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                         max_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def architecture(request):
    return request.param, tiny(request.param)


@pytest.mark.parametrize("cache", list(CACHES))
def test_the_engine_gives_generates_greedy_tokens_on_every_architecture(architecture, cache):
    name, model = architecture
    kivi = CACHES[cache]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    # two slots for three prompts: one slot is refilled; prompts of 13 and 21 tokens run as one micro-batch
    run = DecodeEngine(model, prefill_tokens=48).generate([Sequence(p, NEW_TOKENS) for p in prompts], kivi, slots=2)
    enable_kivi(model)
    for prompt, completion in zip(prompts, run.completions):
        assert completion.tokens == reference(model, prompt, kivi), f"{name}, {cache}, prompt of {len(prompt)} tokens"


def test_the_compiled_prefill_gives_the_eager_prefills_tokens_on_every_architecture(architecture):
    """The prompts' forward compiled (dynamic shapes; transformers' masks traced, sliding windows among them) against
    the same engine eager, under KIVI-2: a micro-batch, a prompt alone and one longer than a window in chunks."""
    name, model = architecture
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in (*PROMPT_LENGTHS, 30)]
    sequences = [Sequence(p, NEW_TOKENS) for p in prompts]
    eager = DecodeEngine(model, prefill_tokens=24, compile_prefill=False).generate(sequences, CACHES["kivi-2"], slots=2)
    torch._dynamo.reset()  # a graph per architecture: past the recompile limit, the wrapper would run eagerly
    torch._dynamo.utils.counters.clear()
    compiled = DecodeEngine(model, prefill_tokens=24, compile_prefill=True).generate(sequences, CACHES["kivi-2"], slots=2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, f"{name}: nothing was compiled"
    for prompt, a, b in zip(prompts, compiled.completions, eager.completions):
        assert a.tokens == b.tokens, f"{name}, prompt of {len(prompt)} tokens"


def test_a_sliding_layer_keeps_its_window_in_16_bits_and_counts_its_bytes():
    config = Gemma3TextConfig(**SHAPE | ARCHITECTURES["gemma3 (hybrid, one KV head)"][1])
    cache = SlotCache(config, batch=2, capacity=40, dtype=torch.float32, device="cpu", kivi=KiviConfig(group_size=16,
                                                                                                    residual_length=16))
    sliding, full = cache.layers[0], cache.layers[2]
    assert sliding.is_sliding and sliding.keys.shape == (2, 1, WINDOW, 32) and sliding.keys.dtype == torch.float32
    assert not full.is_sliding and full.keys.codes.dtype == torch.int32
    assert cache.kv_bytes(2) == sum(layer.nbytes(2) for layer in cache.layers)
    assert sliding.nbytes(2) == 2 * 2 * 1 * WINDOW * 32 * 2  # keys + values, 2 slots, 1 head, the window, 16 bits


REFUSED = {
    "multi-head latent attention": ("deepseek_v3", dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                                        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                                        num_experts_per_tok=2, moe_intermediate_size=32), "latent"),
    "key/value sharing": ("gemma3n_text", dict(num_kv_shared_layers=1, layer_types=["sliding_attention"] +
                                               ["full_attention"] * 2, sliding_window=WINDOW, head_dim=16), "shares keys"),
    "linear attention": ("qwen3_next", dict(layer_types=["linear_attention", "linear_attention", "full_attention"]),
                         "linear_attention"),
    "encoder-decoder": ("t5", dict(d_model=64, d_kv=16, num_heads=4, num_layers=2), "encoder-decoder"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_no_kivi_cache_can_hold_is_refused_from_the_config_alone(case):
    model_type, extra, reason = REFUSED[case]
    config = AutoConfig.for_model(model_type, **SHAPE | extra)
    for build in (lambda: KiviCache(config, KiviConfig()),
                  lambda: SlotCache(config, 1, 8, torch.float16, "meta", KiviConfig()),
                  lambda: SlotCache(config, 1, 8, torch.float16, "meta")):
        with pytest.raises(KiviConfigError, match=reason):
            build()
    if not config.is_encoder_decoder:  # transformers builds no causal LM of one at all
        assert reason in unsupported(meta_model(config))


def test_dynamic_rotary_scaling_and_attention_sinks_are_refused_by_the_step_before_load():
    dynamic = LlamaConfig(**SHAPE, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))
    assert "'dynamic' rotary scaling" in unsupported(meta_model(dynamic))
    sinks = AutoConfig.for_model("gpt_oss", **SHAPE | dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                           layer_types=["full_attention"] * 3, dtype="bfloat16"))
    assert "['s_aux']" in unsupported(meta_model(sinks))


def test_a_forward_that_skips_a_layers_cache_is_refused():
    model = tiny("qwen2 (qkv bias)")
    model.model.layers[1].self_attn.forward = _attention_without_cache(model.model.layers[1].self_attn)
    assert "layer 1: its keys and values are not stored" in unsupported(model)


def _attention_without_cache(attn):
    forward = attn.forward

    def without_cache(hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        return forward(hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs)

    return without_cache
