"""Continuous batching on a static cache: the one generation engine for every workload, fp16 or KIVI.

A call holds a fixed number of slots in one ``SlotCache`` (KIVI or the model dtype) and a queue of waiting
sequences, longest first (prompt + new tokens: the longest start early instead of running alone at the end):

1. admission: each free slot takes the next waiting sequence. Its prompt runs through the stock model (exact
   attention, as KIVI prescribes), right-padded in micro-batches of similar lengths and about
   ``prefill_tokens`` tokens; a prompt longer than that runs in chunks of that size over a DynamicCache of its
   own, so one 32K prompt does not stall the others for long: while sequences decode, one prefill unit (a
   micro-batch or a chunk) runs between two decode segments. The finished prompt's keys and values are
   stored into its slot (quantized there under KIVI) and its first token taken (greedy, or drawn with its
   ``Sampling``: pipeline.sampling, the same in every decode step).
2. decode: segments of at most ``sync_every`` steps (``pipeline.decode_step``, replayed from one CUDA graph
   on CUDA; every slot steps, an idle one in place), each step's tokens kept on the device; a segment never
   runs a sequence past its own ``max_new_tokens``.
3. after a segment, one copy to the host: a sequence ends at an end id (EOS), a stop string, or its
   ``max_new_tokens``; its tokens are cut there, its slot is released and refilled at the next admission.

Outputs come back in the order of the sequences given.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache, PreTrainedModel

from kivi import KiviConfig
from kivi.cache import FP16_BYTES
from kivi.slot_cache import SlotCache
from pipeline.decode_step import DecodeStep
from pipeline.sampling import GREEDY, Sampling, SlotSampling, next_tokens

@dataclass(frozen=True)
class Sequence:
    """One request as the engine runs it."""

    prompt: list[int]  # token ids, fed as they are
    max_new_tokens: int
    end_ids: frozenset[int] = frozenset()  # ids that end it, excluded from its tokens (EOS); none: runs to the limit
    stop: tuple[str, ...] = ()  # stop strings: it ends with the token that completes one (needs a tokenizer)
    sampling: Sampling | None = None  # None: greedy


@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # generated ids: an ending EOS left out, a stop string's tokens kept
    finish_reason: Literal["eos", "stop", "length"]
    latency_s: float  # from the start of its prefill to its last token


@dataclass(frozen=True)
class DecodeRun:
    completions: list[Completion]  # in the order of the sequences given
    prefill_s: float  # prompt forward passes and loads into slots
    decode_s: float  # decode segments, their host copies included
    capture_s: float  # warm-up and graph capture (0 without a graph)
    steps: int  # decode steps
    slots: int
    admissions: int  # sequences loaded into a slot (more than ``slots``: slots were refilled)
    peak_mem_bytes: int | None  # CUDA: the call's peak allocated memory, weights included
    cache_bytes: int  # the static cache's buffers, model-dtype elements at 16 bits: that cache in a 16-bit model

    @property
    def step_s(self) -> float:
        return self.decode_s / max(self.steps, 1)

    @property
    def tokens(self) -> torch.Tensor:
        """[sequences, new tokens] int64: the generations of a call whose sequences all ran to the same length."""
        return torch.tensor([c.tokens for c in self.completions], dtype=torch.long)


class DecodeEngine:
    def __init__(self, model: PreTrainedModel, prefill_tokens: int = 4096, cuda_graph: bool = True,
                 compile_steps: bool | None = None, sync_every: int = 16, decode: Callable[[list[int]], str] | None = None):
        """``decode`` (token ids -> text) is needed for stop strings; ``sync_every`` bounds the steps between two
        looks at the tokens (EOS and stop strings are found that late, length limits exactly)."""
        self.model, self.decode_step = model, DecodeStep(model, compile_steps)
        self.prefill_tokens, self.cuda_graph, self.sync_every, self.decode = prefill_tokens, cuda_graph, sync_every, decode
        self.device, self.dtype = model.device, model.dtype

    def run(self, prompts: list[list[int]], new_tokens: int, kivi: KiviConfig | None) -> DecodeRun:
        """``new_tokens`` greedy tokens for every prompt, all in one batch, no end ids (a throughput point).

        Raises torch.OutOfMemoryError when the batch does not fit.
        """
        return self.generate([Sequence(p, new_tokens) for p in prompts], kivi, slots=len(prompts),
                             sync_every=max(new_tokens - 1, 1))

    @torch.inference_mode()
    def generate(self, sequences: list[Sequence], kivi: KiviConfig | None, slots: int,
                 sync_every: int | None = None) -> DecodeRun:
        """Generations of ``sequences`` (greedy unless one has a Sampling) through ``slots`` slots; fp16 cache when kivi
        is None."""
        if not sequences or min(len(s.prompt) for s in sequences) == 0 or min(s.max_new_tokens for s in sequences) < 1:
            raise ValueError("DecodeEngine.generate: needs non-empty prompts and max_new_tokens >= 1")
        if self.decode is None and any(s.stop for s in sequences):
            raise ValueError("DecodeEngine.generate: stop strings need the engine's decode function")
        cuda = self.device.type == "cuda"
        gc.collect()  # the last call's buffers, if an exception kept them alive
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        capacity = max(len(s.prompt) + s.max_new_tokens - 1 for s in sequences)  # the last token is never stored
        cache = SlotCache(self.model.config, min(slots, len(sequences)), capacity, self.dtype, self.device, kivi)
        batch = _Batch(self, cache, sequences, sync_every or self.sync_every)
        completions = batch.run()
        return DecodeRun(completions, batch.prefill_s, batch.decode_s, batch.capture_s, batch.steps, cache.state.batch,
                         batch.admissions, torch.cuda.max_memory_allocated(self.device) if cuda else None,
                         cache.kv_bytes(FP16_BYTES))


@dataclass
class _Live:
    """A sequence in a slot."""

    index: int  # in the call's sequences
    began: float
    tokens: list[int] = field(default_factory=list)


@dataclass
class _Prefill:
    """A unit of prefill work: a micro-batch of prompts, or the chunks of one long prompt."""

    rows: list[int]  # sequence indices
    slots: list[int]
    began: float
    kv: DynamicCache | None = None  # a chunked prompt's keys and values so far
    done: int = 0  # tokens of a chunked prompt already run


class _Batch:
    """The state of one ``DecodeEngine.generate`` call."""

    def __init__(self, engine: DecodeEngine, cache: SlotCache, sequences: list[Sequence], sync_every: int):
        self.engine, self.cache, self.sequences, self.sync_every = engine, cache, sequences, sync_every
        device, slots = engine.device, cache.state.batch
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # each step's input, then its output
        self.history = torch.empty(slots, sync_every, dtype=torch.long, device=device)
        # Each slot's sampling values, where any sequence samples; otherwise every step is a plain argmax.
        sampled = any(s.sampling and not s.sampling.greedy for s in sequences)
        self.sampling = SlotSampling(slots, device) if sampled else None
        order = sorted(range(len(sequences)), key=lambda i: -(len(sequences[i].prompt) + sequences[i].max_new_tokens))
        self.waiting, self.free = deque(order), list(range(slots))
        self.prefills: deque[_Prefill] = deque()
        self.live: dict[int, _Live] = {}  # slot -> sequence
        self.completions: list[Completion | None] = [None] * len(sequences)
        self.graph = None
        self.prefill_s = self.decode_s = self.capture_s = 0.0
        self.steps = self.admissions = 0

    def run(self) -> list[Completion]:
        while self.waiting or self.prefills or self.live:
            self._admit()
            if not self.live:  # nothing decodes: nothing waits for the prefill
                while self.prefills:
                    self._prefill_one()
                continue
            if self.prefills:  # one unit between two segments, so that the live sequences go on
                self._prefill_one()
            self._segment()
        return self.completions

    def _admit(self) -> None:
        taken = []
        while self.free and self.waiting:
            taken.append((self.waiting.popleft(), self.free.pop(0)))
        if not taken:
            return
        now = time.perf_counter()
        lengths = [len(self.sequences[row].prompt) for row, _ in taken]
        for group in _micro_batches(lengths, self.engine.prefill_tokens):
            self.prefills.append(_Prefill([taken[j][0] for j in group], [taken[j][1] for j in group], now))

    def _prefill_one(self) -> None:
        began = time.perf_counter()
        job = self.prefills[0]
        first = self._forward(job)
        if first is not None:
            self.prefills.popleft()
            self._start(job, first)
        self._sync()
        self.prefill_s += time.perf_counter() - began

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def _forward(self, job: _Prefill) -> list[int] | None:
        """Run the job's next unit through the stock model; the first greedy tokens once its prompts are done."""
        engine, prompts = self.engine, [self.sequences[row].prompt for row in job.rows]
        model, base, device = engine.model, engine.model.get_decoder(), engine.device
        chunk = engine.prefill_tokens
        if len(prompts) == 1 and len(prompts[0]) > chunk:  # a long prompt: one chunk per unit, exact attention
            job.kv = job.kv or DynamicCache(config=model.config)
            ids = torch.tensor([prompts[0][job.done : job.done + chunk]], device=device)
            hidden = base(input_ids=ids, past_key_values=job.kv, use_cache=True).last_hidden_state
            job.done += ids.shape[1]
            if job.done < len(prompts[0]):
                return None
            lengths, kv, last = torch.tensor([len(prompts[0])]), job.kv, hidden[:, -1]
        else:
            lengths = torch.tensor([len(p) for p in prompts])
            width = int(lengths.max())
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            for j, prompt in enumerate(prompts):
                ids[j, : len(prompt)] = torch.as_tensor(prompt)
            mask = torch.arange(width)[None, :] < lengths[:, None]
            kv = DynamicCache(config=model.config)
            hidden = base(input_ids=ids.to(device), attention_mask=mask.to(device), past_key_values=kv,
                          use_cache=True).last_hidden_state
            last = hidden[torch.arange(len(prompts), device=device), lengths.to(device) - 1]
        slots = torch.tensor(job.slots, device=device)
        first = self._choose(model.lm_head(last), job.rows, slots, lengths.to(device))
        self.cache.load(slots, [(layer.keys, layer.values) for layer in kv.layers], lengths)
        self.tokens[slots] = first
        return first.tolist()

    def _choose(self, logits: torch.Tensor, rows: list[int], slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first tokens of the sequences ``rows`` admitted to ``slots``, whose Sampling the slots take now."""
        if self.sampling is None:
            return logits.argmax(-1)
        self.sampling.set(slots, [self.sequences[row].sampling or GREEDY for row in rows])
        return next_tokens(logits, self.sampling.select(slots), positions)

    def _start(self, job: _Prefill, first: list[int]) -> None:
        self.admissions += len(job.rows)
        for row, slot, token in zip(job.rows, job.slots, first):
            self.live[slot] = _Live(row, job.began, [token])
            self._check(slot, 0)

    def _segment(self) -> None:
        began = time.perf_counter()
        n = min(self.sync_every, min(self.sequences[s.index].max_new_tokens - len(s.tokens) for s in self.live.values()))
        engine = self.engine
        if self.graph is None and self.cache.use_kernels and engine.cuda_graph and engine.device.type == "cuda":
            self.graph = engine.decode_step.capture(self.cache, self.tokens, self.sampling)
            self._sync()
            self.capture_s = time.perf_counter() - began
            began = time.perf_counter()
        for j in range(n):
            self.graph.replay() if self.graph is not None else engine.decode_step.step(self.cache, self.tokens, self.sampling)
            self.history[:, j].copy_(self.tokens)
        history = self.history[:, :n].tolist()  # the segment's one host copy
        self.steps += n
        for slot, live in list(self.live.items()):
            start = len(live.tokens)
            live.tokens += history[slot]
            self._check(slot, start)
        self.decode_s += time.perf_counter() - began

    def _check(self, slot: int, start: int) -> None:
        """End the sequence in ``slot`` if its tokens from ``start`` on hold an end id, complete a stop string, or
        reach its limit."""
        live = self.live[slot]
        sequence, tokens = self.sequences[live.index], live.tokens
        end = next((i for i in range(start, len(tokens)) if tokens[i] in sequence.end_ids), None)
        finish = None
        if sequence.stop:
            decode = self.engine.decode
            upto = len(tokens) if end is None else end
            if any(s in decode(tokens[:upto]) for s in sequence.stop):
                cut = next(n for n in range(start + 1, upto + 1) if any(s in decode(tokens[:n]) for s in sequence.stop))
                finish = (cut, "stop")
        if finish is None and end is not None:
            finish = (end, "eos")
        if finish is None and len(tokens) >= sequence.max_new_tokens:
            finish = (sequence.max_new_tokens, "length")
        if finish is None:
            return
        keep, reason = finish
        self.completions[live.index] = Completion(tokens[:keep], reason, time.perf_counter() - live.began)
        del self.live[slot]
        released = torch.tensor([slot], device=self.engine.device)
        self.cache.release(released)
        if self.sampling is not None:
            self.sampling.clear(released)
        self.free.append(slot)


def _micro_batches(lengths: list[int], budget: int) -> Iterator[list[int]]:
    """Row indices, shortest prompt first, cut where the padded size (rows x longest prompt) would pass ``budget``
    tokens: prompts of similar length share a micro-batch, so little of the prefill goes to padding."""
    batch: list[int] = []
    for row in sorted(range(len(lengths)), key=lengths.__getitem__):
        if batch and lengths[row] * (len(batch) + 1) > budget:
            yield batch
            batch = []
        batch.append(row)
    yield batch
