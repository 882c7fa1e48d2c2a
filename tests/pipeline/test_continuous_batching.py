"""Continuous batching on the static cache: slots refilled as sequences end, outputs equal to one-at-a-time
decoding and to transformers.generate, in request order; end ids, stop strings, sampled sequences and the fallback
to generate.

On the CPU the steps run eagerly on the kivi/ oracle; on the GPU the same scheduler replays one CUDA graph.
"""

import dataclasses
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kivi import KiviCache, KiviConfig, enable_kivi
from pipeline.decode_engine import DecodeEngine, Sequence
from pipeline.engine import Engine
from pipeline.models import load_tokenizer
from pipeline.sampling import Sampling, SlotSampling, next_tokens
from pipeline.workloads import Request

KIVI_CACHES = [None, KiviConfig(residual_length=32)]
CACHE_IDS = ["fp16", "kivi-2 R32"]


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)  # peaky: no near-ties
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(1, 512, (n,), generator=gen).tolist() for n in lengths]


def generate_alone(model, prompt: list[int], new_tokens: int, kivi: KiviConfig | None) -> list[int]:
    ids = torch.tensor([prompt])
    cache = None if kivi is None else KiviCache(model.config, kivi)
    enable_kivi(model)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                         max_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kivi", KIVI_CACHES, ids=CACHE_IDS)
def test_slots_are_refilled_as_sequences_end_and_each_output_equals_generate_alone_in_request_order(model, kivi):
    lengths, news = (45, 7, 100, 20, 33, 9, 60), (30, 5, 12, 40, 3, 25, 8)
    sequences = [Sequence(p, n) for p, n in zip(prompts(*lengths), news)]
    # Two slots for seven sequences; 32-token prefill units, so the 100- and 60-token prompts run in chunks
    # between decode segments of the others.
    engine = DecodeEngine(model, prefill_tokens=32, sync_every=4)
    run = engine.generate(sequences, kivi, slots=2)
    assert run.slots == 2 and run.admissions == len(sequences)
    for sequence, completion in zip(sequences, run.completions, strict=True):
        assert completion.finish_reason == "length"
        assert completion.tokens == generate_alone(model, sequence.prompt, sequence.max_new_tokens, kivi), len(sequence.prompt)


def first_new(tokens: list[int], at_least: int) -> int:
    """The first index >= at_least whose token did not occur before it."""
    return next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("sync_every", [1, 8])
def test_a_sequence_ends_at_an_end_id_left_out_of_its_tokens_while_the_others_go_on(model, sync_every):
    p = prompts(30, 50, 12)
    engine = DecodeEngine(model, sync_every=sync_every)
    alone = [engine.generate([Sequence(x, 24)], None, slots=1).completions[0].tokens for x in p]
    end = first_new(alone[0], 5)
    run = engine.generate([Sequence(x, 24, frozenset({alone[0][end]})) for x in p], None, slots=2)
    assert run.completions[0].tokens == alone[0][:end] and run.completions[0].finish_reason == "eos"
    for i in (1, 2):  # the same end id may end the others too, exactly where it first appears
        cut = alone[i].index(alone[0][end]) if alone[0][end] in alone[i] else 24
        assert run.completions[i].tokens == alone[i][:cut]


def test_a_sequence_ends_with_the_token_that_completes_a_stop_string(model):
    def decode(ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in ids)

    p = prompts(25, 40)
    engine = DecodeEngine(model, sync_every=8, decode=decode)
    alone = engine.generate([Sequence(x, 30) for x in p], None, slots=2).completions
    tokens = alone[0].tokens
    at = next(i for i in range(4, 30) if decode(tokens[i - 1 : i + 1]) not in decode(tokens[:i]))
    stop = decode(tokens[at - 1 : at + 1])  # two tokens' text, first complete at token `at`
    run = engine.generate([Sequence(p[0], 30, stop=(stop,)), Sequence(p[1], 30)], None, slots=2)
    assert run.completions[0].tokens == tokens[: at + 1] and run.completions[0].finish_reason == "stop"
    assert run.completions[1].tokens == alone[1].tokens  # the other slot is untouched


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def requests(n: int) -> list[Request]:
    return [Request(f"r{i}", "w", "t", "Needles and haystacks " * (i + 2), 6 + i, "{}") for i in range(n)]


def engine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pipeline.engine"]


def test_the_engine_generates_through_the_decode_engine_and_falls_back_to_generate_with_one_log_line(
        model, tokenizer, caplog):
    engine = Engine(model, tokenizer)
    with caplog.at_level(logging.INFO, logger="pipeline.engine"):
        direct = engine.generate(requests(5), None, batch_size=2)
    assert engine_lines(caplog) == [] and {g.finish_reason for g in direct} <= {"eos", "length"}
    # Per-token keys are not what the static cache holds: generate serves them, said once per cache.
    token_keys = KiviConfig.from_name("token-keys-2")
    with caplog.at_level(logging.INFO, logger="pipeline.engine"):
        for _ in range(2):
            fallen = engine.generate(requests(3), token_keys, batch_size=2)
    (line,) = engine_lines(caplog)
    assert "kivi-k2v2-g32-r128-ktoken: generating with transformers.generate" in line and "key_axis" in line
    assert {g.finish_reason for g in fallen} <= {"eos", "length"} and all(g.output_tokens <= 6 + i for i, g in enumerate(fallen))
    sampled = [dataclasses.replace(r, sampling=Sampling(temperature=1.0)) for r in requests(2)]
    with pytest.raises(ValueError, match="sampling runs on the decode engine only"):
        engine.generate(sampled, token_keys, batch_size=2)  # generate's draws would depend on the batch


def test_a_model_the_decode_engine_cannot_drive_generates_through_transformers(model, tokenizer, caplog):
    # Dynamic NTK scaling changes nothing below the trained length, so the tokens are the plain model's.
    config = LlamaConfig(**model.config.to_dict() | dict(rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                                             rope_theta=10000.0)))
    dynamic = LlamaForCausalLM(config).eval()
    dynamic.load_state_dict(model.state_dict())
    engine = Engine(dynamic, tokenizer)
    with caplog.at_level(logging.INFO, logger="pipeline.engine"):
        fallen = engine.generate(requests(2), None, batch_size=2)
    (line,) = engine_lines(caplog)
    assert "fp16: generating with transformers.generate" in line and "'dynamic' rotary scaling" in line
    direct = Engine(model, tokenizer).generate(requests(2), None, batch_size=2)
    assert [g.text for g in fallen] == [g.text for g in direct]  # the same greedy tokens either way


def sample_alone(model, prompt: list[int], new_tokens: int, kivi: KiviConfig | None, sampling: Sampling) -> list[int]:
    """The definition: the model's own forward over a transformers cache, each token drawn by next_tokens at its
    index in the sequence."""
    cache = KiviCache(model.config, kivi) if kivi else None
    enable_kivi(model)
    params = SlotSampling(1, "cpu")
    params.set(torch.tensor([0]), [sampling])
    tokens, feed = [], torch.tensor([prompt])
    with torch.inference_mode():
        out = model(feed, use_cache=True, past_key_values=cache)
        for _ in range(new_tokens):
            token = next_tokens(out.logits[:, -1], params, torch.tensor([len(prompt) + len(tokens)]))
            tokens.append(int(token))
            out = model(token[:, None], past_key_values=out.past_key_values, use_cache=True)
    return tokens


@pytest.mark.parametrize("kivi", KIVI_CACHES, ids=CACHE_IDS)
def test_sampled_sequences_draw_their_own_tokens_whatever_slot_batch_or_refill_and_greedy_ones_stay_greedy(model, kivi):
    lengths, news = (30, 9, 52, 14, 25), (20, 12, 6, 24, 10)
    samplings = [Sampling(temperature=1.2, seed=7), None, Sampling(temperature=0.8, top_k=20, seed=7),
                 Sampling(temperature=1.0, top_p=0.9, seed=-3), Sampling(temperature=1.5, top_k=50, top_p=0.8, seed=1)]
    sequences = [Sequence(p, n, sampling=s) for p, n, s in zip(prompts(*lengths), news, samplings)]
    engine = DecodeEngine(model, prefill_tokens=32, sync_every=4)
    two_slots = engine.generate(sequences, kivi, slots=2).completions
    for sequence, completion in zip(sequences, two_slots, strict=True):
        want = (generate_alone(model, sequence.prompt, sequence.max_new_tokens, kivi) if sequence.sampling is None
                else sample_alone(model, sequence.prompt, sequence.max_new_tokens, kivi, sequence.sampling))
        assert completion.tokens == want, len(sequence.prompt)
    reordered = engine.generate(sequences[::-1], kivi, slots=5).completions[::-1]  # other slots, one batch
    assert [c.tokens for c in reordered] == [c.tokens for c in two_slots]
