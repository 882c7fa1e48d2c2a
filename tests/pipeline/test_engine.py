"""The engine on a random-weight model whose vocabulary is smaller than its borrowed tokenizer's; the
reproducibility probe."""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kivi import KiviConfig
from pipeline.config import load_config
from pipeline.decode_engine import _compiled_prompt_logits, _prompt_logits
from pipeline.engine import Engine, Generation
from pipeline.models import load_tokenizer
from pipeline.workloads import Request, TeacherForcing
from tools.sdpa_determinism import agreement


def tiny_engine() -> Engine:
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return Engine(LlamaForCausalLM(config).eval(), load_tokenizer("smollm2-135m"))  # 49,152 ids


def test_ids_past_the_vocabulary_fold_into_it_on_every_path():
    engine = tiny_engine()
    tokenizer = engine.tokenizer
    prompt = "Needles, haystacks and quantized caches"
    assert max(tokenizer(prompt, add_special_tokens=False).input_ids) >= 512
    requests = [Request(f"r{i}", "niah", "niah", prompt * (i + 1), 5, "{}") for i in range(2)]

    for kivi in (None, KiviConfig(residual_length=32)):
        generations = engine.generate(requests, kivi, batch_size=2)
        assert [g.prompt_tokens for g in generations] == [len(tokenizer(r.prompt).input_ids) for r in requests]
        point = engine.throughput(requests, kivi, batch_size=2, max_new_tokens=3)
        assert point["gen_len"] == 3 and point["tokens_per_s"] > 0 and repr(kivi) in engine.warmed
    fidelity = Request("f", "fidelity", "fidelity", prompt * 8, 0, "{}", teacher_forcing=TeacherForcing(48, 16))
    stats = engine.teacher_forced(fidelity, KiviConfig(residual_length=32))
    assert stats["tokens"] == 48 and 0 <= stats["top1_agreement"] <= 1


def test_the_prefill_is_compiled_where_the_config_asks(write_config, data_dir):
    """model.compile_prefill (default off) reaches the decode engine, as a worker builds it."""
    model, tokenizer = tiny_engine().model, load_tokenizer("smollm2-135m")
    for fields, compiled in (({}, False), ({"compile_prefill": True}, True)):
        path = write_config(model={"spec": "smollm2-135m", **fields}, data_dir=str(data_dir), workloads={"gsm8k": {"n": 2}})
        engine = Engine(model, tokenizer, load_config(path).model.compile_prefill)
        assert engine.decoder.prompt_logits is (_compiled_prompt_logits if compiled else _prompt_logits)


def test_kv_bytes_are_counted_at_16_bits_so_fp16_compresses_1x_in_a_float32_model_too():
    float32 = tiny_engine()
    bfloat16 = Engine(copy.deepcopy(float32.model).to(torch.bfloat16), float32.tokenizer)
    requests = [Request(f"r{i}", "sharegpt", "sharegpt", "a haystack " * (20 + i), 4, "{}") for i in range(2)]
    points = {(engine.model.dtype, kivi is None): engine.throughput(requests, kivi, batch_size=2, max_new_tokens=4)
              for engine in (float32, bfloat16) for kivi in (None, KiviConfig(residual_length=32))}
    for dtype in (torch.float32, torch.bfloat16):
        fp16 = points[(dtype, True)]
        assert fp16["kv_bytes"] == fp16["fp16_kv_bytes"]  # the report's "KV compression" reads 1.00
    # KIVI's ratio is its ratio to a 16-bit cache, the same for either copy of the model.
    kivi32, kivi16 = points[(torch.float32, False)], points[(torch.bfloat16, False)]
    assert kivi32["kv_bytes"] == kivi16["kv_bytes"] and kivi32["fp16_kv_bytes"] == kivi16["fp16_kv_bytes"]


def test_the_probe_counts_requests_decoded_the_same_in_two_passes(monkeypatch):
    engine = tiny_engine()
    requests = [Request(f"r{i}", "niah", "niah", "a haystack " * (i + 3), 4, "{}") for i in range(3)]
    assert agreement(engine, requests, batch_size=2) == 3  # the CPU path is deterministic
    passes = iter([["x", "y", "z"], ["x", "q", "z"]])
    monkeypatch.setattr(engine, "generate", lambda *args: [Generation(t, 1, 1, 0.0) for t in next(passes)])
    assert agreement(engine, requests) == 2
