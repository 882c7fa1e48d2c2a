"""The static decode engine gives transformers.generate's greedy tokens, fp16 cache and KIVI, ragged batches.

generate runs each prompt alone with EOS disabled (the engine ignores EOS); the engine runs them together.
On the CPU the engine's steps run eagerly on the kivi/ oracle; the GPU run (CUDA graph, Triton kernels) is
`python -m tools.bench_decode --check-model` (BENCHMARKS.md).
"""

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kivi import KiviCache, KiviConfig, enable_kivi
from pipeline.decode_engine import DecodeEngine, _Batch, _micro_batches
from pipeline.decode_step import UnsupportedModelError

KIVI_CACHES = [None, KiviConfig(residual_length=32), KiviConfig(k_bits=4, v_bits=2, group_size=16, residual_length=0)]
CACHE_IDS = ["fp16", "kivi-2 R32", "k4v2 G16 R0"]


def tiny(model_cls, config_cls, heads, kv_heads, head_dim):
    config = config_cls(vocab_size=512, hidden_size=heads * head_dim, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        initializer_range=0.2)  # peaky logits: no near-ties in greedy decoding
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None
    return model


def generate_alone(model, prompt: list[int], new_tokens: int, kivi: KiviConfig | None) -> torch.Tensor:
    ids = torch.tensor([prompt])
    cache = None if kivi is None else KiviCache(model.config, kivi)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                         max_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(prompt):]


def assert_engine_matches_generate(model, prompts, new_tokens, kivi):
    engine = DecodeEngine(model, prefill_tokens=160)  # several prefill micro-batches
    run = engine.run(prompts, new_tokens, kivi)
    assert run.tokens.shape == (len(prompts), new_tokens)
    enable_kivi(model)
    for prompt, got in zip(prompts, run.tokens):
        assert torch.equal(got, generate_alone(model, prompt, new_tokens, kivi)), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("kivi", KIVI_CACHES, ids=CACHE_IDS)
@pytest.mark.parametrize("layout", ["llama GQA", "qwen2 (qkv bias)"])
def test_engine_gives_generates_tokens_on_a_ragged_batch(layout, kivi):
    model = tiny(LlamaForCausalLM, LlamaConfig, 4, 2, 64) if layout.startswith("llama") else tiny(Qwen2ForCausalLM, Qwen2Config, 4, 1, 64)
    gen = torch.Generator().manual_seed(3)
    # 64: a prompt that ends a key block, which the first step's flush quantizes (again) from the residual
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (45, 7, 70, 64)]
    assert_engine_matches_generate(model, prompts, 40, kivi)  # past the first flushes of every sequence


def test_prefill_micro_batches_group_similar_lengths_within_the_token_budget():
    lengths = [50, 10, 90, 90, 5, 200, 1]
    batches = list(_micro_batches(lengths, 180))
    assert batches == [[6, 4, 1], [0, 2], [3], [5]]
    assert sorted(sum(batches, [])) == list(range(len(lengths)))
    assert all(max(lengths[r] for r in b) * len(b) <= 180 or len(b) == 1 for b in batches)


def test_engine_refuses_models_it_cannot_drive():
    model = tiny(LlamaForCausalLM, LlamaConfig, 4, 2, 64)
    model.config.rope_parameters = dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)
    with pytest.raises(UnsupportedModelError, match="'dynamic' rotary scaling sets its frequencies"):
        DecodeEngine(model)


def test_the_engine_on_the_oracle_refuses_compiled_steps():
    """use_kernels=False reads the cache's counts on the host: a compiled step cannot (the CUDA default compiles)."""
    model = tiny(LlamaForCausalLM, LlamaConfig, 4, 2, 64)
    with pytest.raises(ValueError, match="set compile_steps=False"):
        DecodeEngine(model, compile_steps=True, use_kernels=False)


def test_compiled_steps_give_the_eager_tokens():
    """On CUDA the engine compiles the parts between attentions; here on the CPU, against the same steps eager."""
    model = tiny(LlamaForCausalLM, LlamaConfig, 4, 2, 64)
    prompts = [list(range(1, 30)), list(range(5, 12))]
    eager = DecodeEngine(model, compile_steps=False).run(prompts, 12, None).tokens
    assert torch.equal(DecodeEngine(model, compile_steps=True).run(prompts, 12, None).tokens, eager)


def test_a_full_garbage_collection_runs_only_after_a_call_that_raised(monkeypatch):
    """A full collection costs 0.3-1 s once a model fills the heap: it is paid where a call that ran out of memory may
    have left its buffers in reference cycles, not on every call."""
    engine, prompts = DecodeEngine(tiny(LlamaForCausalLM, LlamaConfig, 4, 2, 64), compile_steps=False), [[1, 2, 3]]
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)
    engine.run(prompts, 4, None)
    engine.run(prompts, 4, None)
    assert collections == []
    with monkeypatch.context() as patch:
        patch.setattr(_Batch, "_segment", lambda self: (_ for _ in ()).throw(torch.OutOfMemoryError("out of memory")))
        with pytest.raises(torch.OutOfMemoryError):
            engine.run(prompts, 4, None)
    engine.run(prompts, 4, None)
    engine.run(prompts, 4, None)
    assert len(collections) == 1


@pytest.mark.slow
@pytest.mark.parametrize("kivi", KIVI_CACHES[:2], ids=CACHE_IDS[:2])
def test_on_smollm2_engine_gives_generates_64_tokens(smollm2, data_dir, kivi):
    model, tokenizer = smollm2
    model.generation_config.eos_token_id = None
    essay = sorted((data_dir / "niah" / "PaulGrahamEssays").glob("*.txt"))[0].read_text()
    text = tokenizer(essay, add_special_tokens=False).input_ids
    assert_engine_matches_generate(model, [text[:150], text[:40], text[:300]], 64, kivi)


def test_compiled_prefill_gives_the_eager_tokens_with_one_graph_for_every_micro_batch():
    """compile_prefill compiles the prompts' forward with dynamic shapes; on the CPU, against the same prefill
    eager: micro-batches of three shapes and a long prompt's two chunks, under KIVI (whose slots quantize what the
    prefill stored), through no more graphs than the two paths and a chunk's cache need. The first micro-batch has
    as many distinct ends as rows, a later one fewer (duck sizing would tie the two), the last one only (a size of 1
    would be specialized): either would compile the micro-batch path again."""
    model = tiny(LlamaForCausalLM, LlamaConfig, 4, 2, 64)
    gen = torch.Generator().manual_seed(5)
    # micro-batches of 64 tokens: [5, 6, 7], [17, 17, 18], [30, 30], then 100 in chunks of 64 and 36
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (17, 5, 100, 30, 6, 18, 7, 30, 17)]
    kivi = KiviConfig(residual_length=32)
    eager = DecodeEngine(model, prefill_tokens=64, compile_prefill=False).run(prompts, 8, kivi).tokens
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = DecodeEngine(model, prefill_tokens=64, compile_prefill=True).run(prompts, 8, kivi).tokens
    assert torch.equal(compiled, eager)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 3, f"{graphs} graphs for 6 forwards of 5 shapes: a micro-batch compiled again"
