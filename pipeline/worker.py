"""The evaluation worker: loads the model once, runs shards under every cache configuration, writes Parquet.

The class is plain Python so it runs the same with or without Ray; ``pipeline.runner`` wraps it in a Ray
actor that pins one GPU (or some CPUs). Its model loading (``ModelWorker``) is shared with the generation worker
(``pipeline.generation.worker``). Results are written by the worker as each shard × cache finishes,
one file each, atomically: a dead worker loses only the shard it was on, and a retry overwrites, never
duplicates.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.utils import logging as hf_logging

from pipeline.archive import ArchiveWriter
from pipeline.config import RunConfig
from pipeline.engine import Engine, Generation
from pipeline.models import load_model
from pipeline.workloads import Request, Workload

if TYPE_CHECKING:
    from pipeline.generation.config import GenerateConfig

# Fault injection for the failure tests: the worker process exits when it starts this shard the first time.
CRASH_ONCE_ENV = "KIVI_EVAL_CRASH_ONCE"


@dataclass(frozen=True)
class RunContext:
    run_id: str
    config: RunConfig | GenerateConfig
    started_at: dt.datetime
    git_sha: str | None


@dataclass(frozen=True)
class Shard:
    workload: str
    index: int
    requests: tuple[Request, ...]


def crash_marker(run_id: str, workload: str, shard: int) -> str:
    """The archive file that records the injected crash, so that the retry runs."""
    return f".crashed-{run_id}-{workload}-{shard}"


class ModelWorker:
    """One process's model, loaded once on its device (a GPU, else the CPU), with the engine around it and the run's
    archive: what the Ray actors of evaluation and generation runs share."""

    def __init__(self, ctx: RunContext):
        began = time.perf_counter()
        self.ctx, cfg = ctx, ctx.config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # cuDNN's fused attention, PyTorch's first choice for masked fp16 SDPA on Hopper, is not run-to-run
        # deterministic: the same greedy request decoded twice in one process diverged (BENCHMARKS.md,
        # "Multi-GPU"). The memory-efficient kernel is, so reruns and actors reproduce the fp16 baseline.
        torch.backends.cuda.enable_cudnn_sdp(False)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        # Its bar, forwarded by Ray line by line, would print a dozen lines per actor.
        hf_logging.disable_progress_bar()
        model, tokenizer = load_model(cfg.model.spec, self.device, cfg.model.dtype, tokenizer=cfg.model.tokenizer)
        self.engine = Engine(model, tokenizer, cfg.model.compile_prefill)
        self.archive = ArchiveWriter(cfg.archive, ctx.run_id)
        self._prepare()
        self.load_s = time.perf_counter() - began

    def _prepare(self) -> None:
        """What this kind of worker sets up beside the model (its workloads …), counted in its start-up."""

    def placement(self) -> dict:
        """Where this worker runs: what a multi-GPU run reports per actor."""
        try:
            import ray

            on_ray = ray.is_initialized()
        except ImportError:
            on_ray = False
        gpu_ids = [str(g) for g in ray.get_gpu_ids()] if on_ray else []
        cuda = self.device.type == "cuda"
        # The Ray node tells apart nodes that share a host name (containers, a test cluster on one machine).
        node_id = ray.get_runtime_context().get_node_id() if on_ray else None
        return dict(host=socket.gethostname(), node_id=node_id, pid=os.getpid(), device=str(self.device), ray_gpu_ids=gpu_ids,
                    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                    gpu_name=self.device_name if cuda else None,
                    # The physical GPU, whatever index CUDA_VISIBLE_DEVICES gives it in this process.
                    gpu_uuid=str(torch.cuda.get_device_properties(self.device).uuid) if cuda else None,
                    load_s=round(self.load_s, 1))  # model load and workloads, in this worker's constructor

    def _maybe_crash(self, workload: str, shard: int) -> None:
        if os.environ.get(CRASH_ONCE_ENV) != f"{workload}:{shard}":
            return
        marker = crash_marker(self.ctx.run_id, workload, shard)
        if not self.archive.root.exists(marker):
            self.archive.root.write(marker, b"")
            os._exit(1)  # a hard death, as an OOM kill or a lost node


class EvalWorker(ModelWorker):
    """Runs an evaluation's shards and sweeps under every cache configuration."""

    def _prepare(self) -> None:
        self.workloads: dict[str, Workload] = self.ctx.config.build_workloads()
        self.caches = self.ctx.config.kivi_configs()

    def run_shard(self, shard: Shard, caches: list[str]) -> dict[str, dict]:
        """Generate, score and write one shard under each named cache not yet in the archive (a shard retried after
        its actor died keeps what that actor wrote); returns {cache: {"rows", "seconds"}} of those it wrote."""
        self._maybe_crash(shard.workload, shard.index)
        workload = self.workloads[shard.workload]
        written = {}
        for cache in caches:
            if self.archive.has_results(shard.workload, cache, shard.index):
                continue
            began = time.perf_counter()
            if workload.kind == "teacher_forced":
                rows = [self._fidelity_row(cache, r, workload) for r in shard.requests]
            else:
                generations = self._generate(list(shard.requests), cache)
                rows = [self._row(cache, r, g, err, workload) for r, (g, err) in zip(shard.requests, generations)]
            self.archive.write_results(shard.workload, cache, shard.index, rows)
            written[cache] = dict(rows=len(rows), seconds=time.perf_counter() - began)  # the driver prints progress
        return written

    def run_sweep(self, workload: str, requests: list[Request], cache: str) -> list[dict]:
        """Throughput at doubling batch sizes until OOM or the sweep's limit, each point timed ``repeats`` times;
        perf rows (one per timing) written and returned."""
        sweep, kivi = self.ctx.config.sweep, self.caches[cache]
        rows, batch, oom = [], sweep.start, False
        while not oom and batch <= min(sweep.max_batch, len(requests)):
            for repeat in range(sweep.repeats):
                try:
                    point = self.engine.throughput(requests, kivi, batch, sweep.max_new_tokens)
                except torch.OutOfMemoryError:
                    point = dict(batch_size=batch, oom=True)
                rows.append(dict(model=self.ctx.config.model.spec, cache=cache, workload=workload,
                                 device=self.device_name, repeat=repeat, **point))
                # A sweep runs for minutes: one line per timing, as run_shard prints per shard.
                measured = "OOM" if point["oom"] else f"{point['tokens_per_s']:.1f} tokens/s"
                timing = f" #{repeat}" if sweep.repeats > 1 else ""
                print(f"{workload} sweep {cache} batch {batch}{timing}: {measured}", flush=True)
                if oom := point["oom"]:
                    break
            batch *= 2
        self.archive.write_perf(rows)
        return rows

    def _generate(self, requests: list[Request], cache: str) -> list[tuple[Generation | None, str | None]]:
        batch_size = self.ctx.config.generation.batch_size
        try:
            return [(g, None) for g in self.engine.generate(requests, self.caches[cache], batch_size)]
        except torch.OutOfMemoryError as err:  # recorded per row; the run goes on
            return [(None, f"OutOfMemoryError: {err}".splitlines()[0])] * len(requests)

    def _row(self, cache: str, request: Request, gen: Generation | None, error: str | None, workload: Workload) -> dict:
        score = workload.score(request, gen.text) if gen else None
        return self._common(cache, request, workload) | dict(
            prompt_tokens=gen and gen.prompt_tokens, output_tokens=gen and gen.output_tokens,
            prediction=gen and gen.text, score=score and score.value, metric=score and score.metric,
            latency_s=gen and gen.latency_s, error=error,
        )

    def _fidelity_row(self, cache: str, request: Request, workload: Workload) -> dict:
        began = time.perf_counter()
        stats = self.engine.teacher_forced(request, self.caches[cache])
        row = self._common(cache, request, workload) | dict(
            prompt_tokens=stats["tokens"], output_tokens=0, score=stats["top1_agreement"], metric="top1_agreement_vs_fp16",
            latency_s=time.perf_counter() - began,
        )
        row["meta"] = json.dumps(json.loads(row["meta"]) | {k: stats[k] for k in ("mean_kl", "perplexity")})
        return row

    def _common(self, cache: str, request: Request, workload: Workload) -> dict:
        kivi = self.caches[cache]
        return dict(
            started_at=self.ctx.started_at, git_sha=self.ctx.git_sha, model=self.ctx.config.model.spec,
            workload_version=workload.version, task=request.task, request_id=request.request_id,
            k_bits=kivi and kivi.k_bits, v_bits=kivi and kivi.v_bits, group_size=kivi and kivi.group_size,
            residual_length=kivi and kivi.residual_length, reference=request.reference,
            meta=json.dumps(workload.result_meta(request)),
        )
