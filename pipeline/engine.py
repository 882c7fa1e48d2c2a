"""Generation with one cache configuration: the decode engine (pipeline.decode_engine) for every generating
workload and the throughput sweep, transformers.generate where that engine cannot serve; teacher-forced
fidelity over transformers caches."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kivi import KiviCache, KiviConfig, enable_kivi
from kivi.cache import model_head_dim
from kivi.fidelity import chunked_logprobs, compare
from kivi.config import slot_unsupported
from pipeline.decode_engine import DecodeEngine, DecodeRun, Sequence
from pipeline.decode_step import unsupported
from pipeline.names import FP16
from pipeline.workloads import Request, render_prompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_tokens: int
    output_tokens: int
    latency_s: float  # decode engine: from the request's prefill to its last token; generate: its batch's wall time
    finish_reason: str | None = None  # "eos", "stop" or "length"
    tokens: tuple[int, ...] = ()  # the generated ids: an ending EOS left out, a stop string's tokens kept


def new_cache(model: PreTrainedModel, kivi: KiviConfig | None):
    """The cache a run compares: DynamicCache for the fp16 baseline, KiviCache otherwise."""
    return DynamicCache(config=model.config) if kivi is None else KiviCache(model.config, kivi)


def fallback_reason(model: PreTrainedModel, kivi: KiviConfig | None) -> str | None:
    """Why generations under ``kivi`` go through transformers.generate instead of the decode engine (None: they do
    not). ``model`` may live on the meta device: a driver decides before any weights load."""
    return unsupported(model) or (slot_unsupported(kivi) if kivi is not None else None)


def fp16_bytes(model: PreTrainedModel, tokens: int) -> int:
    """Bytes a 16-bit cache needs for ``tokens`` real tokens: the common yardstick of every cache's kv_bytes."""
    cfg = model.config.get_text_config(decoder=True)
    return 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * model_head_dim(cfg) * tokens


class Engine:
    """Owns the model (loaded once per worker) and runs requests under any cache configuration."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, compile_prefill: bool = False):
        self.model, self.tokenizer = enable_kivi(model), tokenizer
        self.device = model.device
        # A random-weight model may borrow a tokenizer with more ids than its vocabulary: every path folds
        # ids into it (what random weights write means nothing; the lengths, shapes and timings are real).
        self.vocab = model.config.get_text_config(decoder=True).vocab_size
        self.decoder = (None if unsupported(model)
                        else DecodeEngine(model, decode=self._decode, compile_prefill=compile_prefill))
        self.warmed: set[str] = set()  # reprs of the caches the decoder has run once, untimed
        self.last_run: DecodeRun | None = None  # the decode engine's last generate call (timings, slots)
        self.logged: set[str] = set()  # caches whose fallback was logged
        # What generate stops at (the model's EOS ids), and the tokenizer's EOS and padding, which end a row there.
        ends = model.generation_config.eos_token_id
        ends = {ends} if isinstance(ends, int) else set(ends or ())
        if tokenizer is not None:
            ends |= {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
        self.end_ids = frozenset(ends)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def prompt_ids(self, requests: list[Request]) -> list[list[int]]:
        """Token ids of the requests as the engine feeds them (chat template applied where asked)."""
        texts = [render_prompt(self.tokenizer, r.prompt, r.chat) for r in requests]
        return [[t % self.vocab for t in ids] for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    @torch.inference_mode()
    def generate(self, requests: list[Request], kivi: KiviConfig | None, batch_size: int) -> list[Generation]:
        """Generations in request order, ``batch_size`` at a time (the decode engine's slots, refilled as requests
        end; generate's batches), greedy unless a request has a Sampling; each stops at its max_new_tokens, EOS or
        a stop string."""
        if reason := fallback_reason(self.model, kivi):
            name = FP16 if kivi is None else kivi.name
            if any(r.sampling and not r.sampling.greedy for r in requests):
                raise ValueError(f"{name}: sampling runs on the decode engine only, and this cache generates with "
                                 f"transformers.generate ({reason}), whose draws depend on the batch: generate "
                                 "greedily (temperature 0) or with a cache the decode engine holds")
            if name not in self.logged:
                logger.info("%s: generating with transformers.generate, not the decode engine: %s", name, reason)
                self.logged.add(name)
            return self.generate_with_transformers(requests, kivi, batch_size)
        prompts = self.prompt_ids(requests)
        sequences = [Sequence(ids, r.max_new_tokens, frozenset() if r.ignore_eos else self.end_ids, r.stop, r.sampling)
                     for r, ids in zip(requests, prompts)]
        self.last_run = self.decoder.generate(sequences, kivi, slots=batch_size)
        return [Generation(_cut_at_stop(self._decode(c.tokens), r.stop), len(ids), len(c.tokens),
                           c.latency_s, c.finish_reason, tuple(c.tokens))
                for r, ids, c in zip(requests, prompts, self.last_run.completions)]

    @torch.inference_mode()
    def generate_with_transformers(self, requests: list[Request], kivi: KiviConfig | None,
                                   batch_size: int) -> list[Generation]:
        """transformers.generate over left-padded batches of ``batch_size``: the path of what the decode engine
        cannot serve."""
        return [g for start in range(0, len(requests), batch_size)
                for g in self._generate_batch(requests[start : start + batch_size], kivi)]

    def _generate_batch(self, batch: list[Request], kivi: KiviConfig | None) -> list[Generation]:
        tok = self.tokenizer
        enc = tok([render_prompt(tok, r.prompt, r.chat) for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        enc["input_ids"] %= self.vocab
        enc = enc.to(self.device)
        stops = sorted({s for r in batch for s in r.stop})
        began = time.perf_counter()
        ids = self.model.generate(
            **enc, past_key_values=new_cache(self.model, kivi), do_sample=False,
            max_new_tokens=max(r.max_new_tokens for r in batch), pad_token_id=tok.pad_token_id,
            stop_strings=stops or None, tokenizer=tok if stops else None,
        )
        latency = time.perf_counter() - began
        results = []
        for row, request in enumerate(batch):
            new = ids[row, enc.input_ids.shape[1] :][: request.max_new_tokens]
            ended = _until_end(new, {tok.eos_token_id, tok.pad_token_id})
            full = tok.decode(ended, skip_special_tokens=True)
            text = _cut_at_stop(full, request.stop)
            reason = "stop" if len(text) < len(full) else "eos" if len(ended) < len(new) else "length"
            results.append(Generation(text, int(enc.attention_mask[row].sum()), len(ended), latency, reason,
                                      tuple(ended.tolist())))
        return results

    @torch.inference_mode()
    def teacher_forced(self, request: Request, kivi: KiviConfig | None) -> dict[str, float]:
        """Top-1 agreement, mean KL to fp16 and perplexity of the cache on the request's text."""
        tokens, chunk = request.teacher_forcing.tokens, request.teacher_forcing.chunk
        ids = self.tokenizer(request.prompt, return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
        ids = (ids % self.vocab).to(self.device)
        reference = chunked_logprobs(self.model, ids, new_cache(self.model, None), chunk)
        logprobs = reference if kivi is None else chunked_logprobs(self.model, ids, new_cache(self.model, kivi), chunk)
        return compare(reference, logprobs, ids, chunk) | {"tokens": int(ids.shape[1])}

    def throughput(self, requests: list[Request], kivi: KiviConfig | None, batch_size: int, max_new_tokens: int | None) -> dict:
        """Decode the first ``batch_size`` requests together on the static decode engine, EOS ignored, and time it.

        Every sequence generates the batch's longest expected output (capped by ``max_new_tokens``), so the
        tokens counted are exactly the tokens produced. Raises torch.OutOfMemoryError when the batch does not fit.
        """
        batch = requests[:batch_size]
        gen_len = max(r.max_new_tokens for r in batch)
        gen_len = min(gen_len, max_new_tokens) if max_new_tokens else gen_len
        prompts = self.prompt_ids(batch)
        if self.decoder is None:
            raise ValueError(f"the throughput sweep runs on the decode engine: {unsupported(self.model)}")
        if repr(kivi) not in self.warmed:  # Triton builds this cache's kernels here, not in a timed prefill
            self.decoder.run(prompts, 2, kivi)
            self.warmed.add(repr(kivi))
        run = self.decoder.run(prompts, gen_len, kivi)
        capacity = max(map(len, prompts)) + gen_len - 1
        return dict(
            batch_size=len(batch), prompt_len=max(map(len, prompts)), gen_len=gen_len,
            tokens_per_s=len(batch) * gen_len / (run.prefill_s + run.decode_s),
            decode_tokens_per_s=len(batch) * (gen_len - 1) / run.decode_s if gen_len > 1 else None,
            step_ms=1e3 * run.step_s if gen_len > 1 else None, prefill_s=run.prefill_s,
            peak_mem_bytes=run.peak_mem_bytes, kv_bytes=run.cache_bytes,
            fp16_kv_bytes=fp16_bytes(self.model, len(batch) * capacity),  # a 16-bit static cache of the same capacity
            oom=False,
        )


def _until_end(tokens: torch.Tensor, end_ids: set[int]) -> torch.Tensor:
    """The tokens before the first EOS or padding (a finished row of a batch is padded to the end)."""
    hits = torch.isin(tokens, torch.tensor(sorted(end_ids), device=tokens.device)).nonzero()
    return tokens[: int(hits[0])] if len(hits) else tokens


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    return text[:cut]
