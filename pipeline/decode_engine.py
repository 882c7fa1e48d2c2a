"""Continuous batching on a static cache: the one generation engine for every workload, fp16 or KIVI.

A call holds a fixed number of slots in one ``SlotCache`` (KIVI or the model dtype) and a queue of waiting
sequences, longest first (new tokens in powers of two: the longest start early instead of running alone at the
end; then prompt length, so that sequences admitted together have prompts of similar lengths):

1. admission: once enough slots are free (``refill`` of them, or any when nothing decodes), each takes the next
   waiting sequence, and every admitted prompt runs through the stock model (exact attention, as KIVI
   prescribes; compiled where ``compile_prefill`` asks) before decoding goes on:
   right-padded micro-batches of similar lengths and at most ``prefill_tokens`` tokens, one after the other, a
   prompt longer than that in chunks of that size over a DynamicCache of its own. Waiting for several free slots
   makes the micro-batches large enough to run at the model's speed; a slot freed one at a time would be refilled
   with a micro-batch of one prompt. The keys and values of each finished prompt are stored into its slot
   (quantized there under KIVI) and its first token chosen from the model's own logits (greedy, or drawn with its
   ``Sampling``: pipeline.sampling, the same in every decode step); one host copy for all of them.
2. decode: segments of at most ``sync_every`` steps (``pipeline.decode_step``: the model's own forward,
   replayed from one CUDA graph on CUDA; every slot steps, an idle one in place), each step's tokens kept on the
   device; a segment never runs a sequence past its own ``max_new_tokens``.
3. after a segment, one copy to the host: a sequence ends at an end id (EOS), a stop string, or its
   ``max_new_tokens``; its tokens are cut there, its slot is released and refilled at a later admission.

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
import torch.fx.experimental._config as fx_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel

from kivi import KiviConfig, enable_kivi
from kivi.cache import FP16_BYTES
from kivi.slot_cache import SlotCache, to_device
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


# cuDNN's fused attention, PyTorch's first choice for fp16 SDPA on Hopper, builds a plan for every shape it meets
# (0.1-0.4 s each), and prefill micro-batches come in many shapes: on the H200 it ran the prefill of a nightly-like
# load at 26% of the model's speed, and 58% with widths and rows padded to buckets, where the kernels that plan
# nothing ran it at 75-80% (BENCHMARKS.md, "Prefill inside the schedule"). Without a padding mask (``_prefill``)
# the flash kernel serves.
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _prompt_logits(model: PreTrainedModel, ids: torch.Tensor, kv: DynamicCache,
                   keep: int | torch.Tensor) -> torch.Tensor:
    """The model's own forward over prompt tokens into ``kv``: logits at ``keep`` (transformers' logits_to_keep)."""
    return model(input_ids=ids, past_key_values=kv, use_cache=True, logits_to_keep=keep).logits


# Eager, the stock forward spends two fifths of a ShareGPT prefill's GPU time between its matmuls (rotary's
# concatenations and products on transposed views, norms, SiLU); compiled, they fuse, and attention stays on the flash
# kernel (kivi.integration.kivi_mask), but the compile takes a minute or more (BENCHMARKS.md, "The prefill compiled"):
# opt-in (a run's model.compile_prefill). Shapes dynamic: one graph serves every micro-batch (rows x width x distinct
# ends), one the chunks of a long prompt. One wrapper for every engine, so that a second engine on the same model
# reuses its graphs.
_compiled_forward = torch.compile(_prompt_logits, dynamic=True)


def _compiled_prompt_logits(model: PreTrainedModel, ids: torch.Tensor, kv: DynamicCache,
                            keep: int | torch.Tensor) -> torch.Tensor:
    """_prompt_logits compiled, in shapes that never compile a micro-batch again (a minute on a 7B model): at least
    two logit columns (a size of 1 is specialized), and no duck sizing (a first micro-batch with as many distinct
    prompt ends as rows would tie the two sizes). A repeated column is a copy of the one before it."""
    if isinstance(keep, torch.Tensor) and len(keep) == 1:
        keep = keep.repeat(2)
    with fx_config.patch(use_duck_shape=False):
        return _compiled_forward(model, ids, kv, keep)


class DecodeEngine:
    def __init__(self, model: PreTrainedModel, prefill_tokens: int = 8192, cuda_graph: bool = True,
                 compile_steps: bool | None = None, sync_every: int = 16, decode: Callable[[list[int]], str] | None = None,
                 refill: float = 1 / 4, use_kernels: bool | None = None, compile_prefill: bool = False):
        """``decode`` (token ids -> text) is needed for stop strings; ``sync_every`` bounds the steps between two
        looks at the tokens (EOS and stop strings are found that late, length limits exactly); ``refill``: the
        fraction of the slots that must be free before waiting sequences are admitted while others decode (1/4:
        the measured best of 1/8 and 1/4 on a nightly-like load, BENCHMARKS.md "Prefill inside the schedule");
        ``use_kernels`` (default: on CUDA) False: the slot cache on the kivi/ oracle (no CUDA graph, and steps not
        compiled: it reads counts on the host), the reference the engine's kernels are checked against;
        ``compile_prefill`` compiles the prompts' forward (see _compiled_prompt_logits)."""
        # Prefill through the "kivi" attention: exact, and soft-capped where the model asks (SDPA has no soft-capping).
        self.model, self.decode_step = enable_kivi(model), DecodeStep(model, compile_steps)
        if use_kernels is False and self.decode_step.compiled:
            raise ValueError("DecodeEngine: use_kernels=False reads the cache's counts on the host; set compile_steps=False")
        self.prefill_tokens, self.cuda_graph, self.sync_every, self.decode = prefill_tokens, cuda_graph, sync_every, decode
        self.refill, self.use_kernels = refill, use_kernels
        self.device, self.dtype = model.device, model.dtype
        self.prompt_logits = _compiled_prompt_logits if compile_prefill else _prompt_logits
        self._unfinished = False  # whether the last generate call raised

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
        # A call that raised (out of memory) may leave its buffers in reference cycles through its frames: collected
        # then only, as a full collection walks the whole heap (0.25 s a call on a CPU with transformers loaded, 0.44 s
        # after a compile: BENCHMARKS.md "A full collection only after a call that raised").
        if self._unfinished:
            gc.collect()
        self._unfinished = True
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        capacity = max(len(s.prompt) + s.max_new_tokens - 1 for s in sequences)  # the last token is never stored
        cache = SlotCache(self.model.config, min(slots, len(sequences)), capacity, self.dtype, self.device, kivi,
                          self.use_kernels)
        batch = _Batch(self, cache, sequences, sync_every or self.sync_every)
        completions = batch.run()
        self._unfinished = False
        return DecodeRun(completions, batch.prefill_s, batch.decode_s, batch.capture_s, batch.steps, cache.state.batch,
                         batch.admissions, torch.cuda.max_memory_allocated(self.device) if cuda else None,
                         cache.kv_bytes(FP16_BYTES))


@dataclass
class _Live:
    """A sequence in a slot."""

    index: int  # in the call's sequences
    began: float
    tokens: list[int] = field(default_factory=list)


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
        # Longest first, by new tokens in powers of two (those that decode long start early instead of running alone
        # at the end), then by prompt length: sequences admitted together have prompts of similar lengths, so
        # little of their prefill goes to padding.
        order = sorted(range(len(sequences)),
                       key=lambda i: (-sequences[i].max_new_tokens.bit_length(), -len(sequences[i].prompt)))
        self.waiting, self.free = deque(order), list(range(slots))
        self.refill = max(1, round(slots * engine.refill))
        self.live: dict[int, _Live] = {}  # slot -> sequence
        self.completions: list[Completion | None] = [None] * len(sequences)
        self.graph = None
        self.prefill_s = self.decode_s = self.capture_s = 0.0
        self.steps = self.admissions = 0

    def run(self) -> list[Completion]:
        while self.waiting or self.live:
            if self.waiting and self.free and (not self.live or len(self.free) >= min(self.refill, len(self.waiting))):
                self._admit()
            if self.live:
                self._segment()
        return self.completions

    def _admit(self) -> None:
        """Free slots take waiting sequences; their prompts run, micro-batch by micro-batch."""
        began = time.perf_counter()
        taken = []
        while self.free and self.waiting:
            taken.append((self.waiting.popleft(), self.free.pop(0)))
        lengths = [len(self.sequences[row].prompt) for row, _ in taken]
        groups, firsts = list(_micro_batches(lengths, self.engine.prefill_tokens)), []
        for group in groups:
            rows, slots = [taken[j][0] for j in group], to_device(torch.tensor([taken[j][1] for j in group]), self.engine.device)
            prompts = [self.sequences[row].prompt for row in rows]
            first = self._choose(self._prefill(prompts, slots), rows, slots, [len(p) for p in prompts])
            self.tokens[slots] = first
            firsts.append(first)
        self.admissions += len(taken)
        in_order = [taken[j] for group in groups for j in group]
        for (row, slot), token in zip(in_order, torch.cat(firsts).tolist()):  # the admission's one host copy
            self.live[slot] = _Live(row, began, [token])
            self._check(slot, 0)
        self.prefill_s += time.perf_counter() - began

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def _prefill(self, prompts: list[list[int]], slots: torch.Tensor) -> torch.Tensor:
        """Run prompts through the stock model (one right-padded micro-batch, or one long prompt in chunks), store
        their keys and values into ``slots``; the model's own logits of each prompt's next token [b, V]."""
        engine, device = self.engine, self.engine.device
        kv = DynamicCache()  # every position: a sliding layer loads its window from them
        with sdpa_kernel(PREFILL_SDPA):
            if len(prompts) == 1:  # chunks of one prompt (one chunk when it is short), exact attention over the cache
                for start in range(0, len(prompts[0]), engine.prefill_tokens):
                    ids = to_device(torch.tensor([prompts[0][start : start + engine.prefill_tokens]]), device)
                    logits = engine.prompt_logits(engine.model, ids, kv, 1)[:, -1]
                lengths = torch.tensor([len(prompts[0])])
            else:
                lengths = torch.tensor([len(p) for p in prompts])
                ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
                for j, prompt in enumerate(prompts):
                    ids[j, : len(prompt)] = torch.as_tensor(prompt)
                # No padding mask: right padding comes after every real token, so causal attention already keeps it
                # out of them, and unmasked causal attention runs on the flash kernel (a mask forces the
                # memory-efficient kernel over the whole square; BENCHMARKS.md "Prefill inside the schedule"). The
                # padding's own outputs are never read: its keys and values are not loaded, its logits not kept.
                # The logits at each prompt's last position: the columns the prompts end at, then each row's own.
                ends, at = torch.unique(lengths - 1, return_inverse=True)
                logits = engine.prompt_logits(engine.model, to_device(ids, device), kv, to_device(ends, device))
                logits = logits[torch.arange(len(prompts), device=device), to_device(at, device)]
        self.cache.load(slots, [(layer.keys, layer.values) for layer in kv.layers], lengths)
        return logits

    def _choose(self, logits: torch.Tensor, rows: list[int], slots: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The first tokens of the sequences ``rows`` admitted to ``slots`` (at ``positions``, their prompt lengths),
        whose Sampling the slots take now."""
        if self.sampling is None:
            return logits.argmax(-1)
        self.sampling.set(slots, [self.sequences[row].sampling or GREEDY for row in rows])
        return next_tokens(logits, self.sampling.select(slots), to_device(torch.tensor(positions), logits.device))

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
        released = to_device(torch.tensor([slot]), self.engine.device)
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
