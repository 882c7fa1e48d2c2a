"""A run end to end on Ray: requests, deterministic shards, one actor per GPU, resume of what is missing."""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.archive import ArchiveWriter
from pipeline.config import RaySection, RunConfig
from pipeline.engine import fallback_reason
from kivi import KiviConfigError
from kivi.cache import check_fits_model
from kivi.layout import attention_layers, unsupported_layout
from pipeline.errors import ConfigError, InputError
from pipeline.models import FP16_OVERFLOWS, load_model_config, load_tokenizer, meta_model
from pipeline.names import GENERATE
from pipeline.worker import CRASH_ONCE_ENV, EvalWorker, RunContext, Shard
from pipeline.workloads import Request, Workload, check_budget

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kivi" / "kernels"


@dataclass
class RunSummary:
    run_id: str
    computed: list[tuple[str, int, str]] = field(default_factory=list)  # (workload, shard, cache) run now
    reused: int = 0  # shard × cache files already in the archive (a resumed run)
    sweeps: list[str] = field(default_factory=list)
    placements: list[dict] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)  # cache -> why it generates with transformers.generate


def new_run_id(label: str) -> str:
    """``<label>-<UTC start>-<random>``: a run's series first, so ids sort by series, then by time."""
    return f"{label}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


def make_shards(workload: str, requests: list, shard_size: int) -> list[Shard]:
    """Requests ordered by (task, request_id), cut into fixed-size shards: the same config gives the same shards."""
    ordered = sorted(requests, key=lambda r: (r.task, r.request_id))
    return [Shard(workload, i // shard_size, tuple(ordered[i : i + shard_size])) for i in range(0, len(ordered), shard_size)]


def run(config: RunConfig, config_yaml: str, run_id: str | None = None, progress: bool = True,
        in_process: bool = False) -> RunSummary:
    """Run (or resume, when ``run_id`` names an unfinished run) and return what was computed.

    ``in_process``: one worker in this process instead of Ray actors (same worker code, same archive).
    """
    run_id = run_id or new_run_id(config.label)
    archive = ArchiveWriter(config.archive, run_id)
    manifest = archive.read_run()
    if manifest is not None:
        check_resumable(run_id, config.archive, manifest, config.kind, config_yaml, _RESUME_FIELDS)
    fallbacks = check_model(config)  # before the first write: a cache the model cannot hold is a config error
    _check_sweeps(config, fallbacks)
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.spec)  # a bad spec fails before the first write
    ctx = run_context(run_id, config, manifest)
    summary, skipped = RunSummary(run_id), None
    row = manifest_row(ctx, config.kind, config_yaml, label=config.label, baseline_run_id=config.baseline_run_id)
    with recorded(archive, manifest, row, lambda: dict(skipped=skipped, placements=summary.placements,
                                                       fallbacks=summary.fallbacks)):
        shard_jobs, sweep_jobs, skipped = _plan(config, archive, summary, tokenizer, fallbacks)
        if summary.fallbacks:  # kept from the start: a killed driver's manifest says it too
            archive.update_run_status("running", fallbacks=summary.fallbacks)
        _execute(config, ctx, shard_jobs, sweep_jobs, summary, progress, in_process)
    return summary


def run_context(run_id: str, config, manifest: dict | None) -> RunContext:
    """The context every worker of the run gets; a resumed run keeps its start."""
    return RunContext(run_id, config, manifest["started_at"] if manifest else dt.datetime.now(dt.UTC), _git_sha())


def manifest_row(ctx: RunContext, kind: str, config_yaml: str, **fields) -> dict:
    """The manifest a new run starts with."""
    return dict(kind=kind, model=ctx.config.model.spec, git_sha=ctx.git_sha, config_yaml=config_yaml,
                started_at=ctx.started_at, versions=_versions(), **fields)


@contextmanager
def recorded(archive: ArchiveWriter, manifest: dict | None, row: dict, outcome: Callable[[], dict]) -> Iterator[None]:
    """The manifest around a run's work: ``row`` written (a resumed run's ``manifest`` set running again), then
    complete, or failed with the error, and ``outcome()``'s fields either way."""
    if manifest is None:
        archive.write_run(row)
    else:
        archive.update_run_status("running")
    try:
        yield
    except BaseException as err:  # an interrupt too: the manifest never stays "running" after the driver is gone
        archive.update_run_status("failed", **outcome(), error=describe_failure(err))
        raise
    archive.update_run_status("complete", **outcome())


# What decides a run's requests, shards and caches: a resume under other values would take the files of one
# layout for another (shard 0 of 256 requests counted as done for shard 0 of 25).
_RESUME_FIELDS = ("model", "caches", "cache_overrides", "workloads", "generation", "sweep", "ray.shard_size")


class ResumeError(InputError):
    """A run id resumed with a config whose requests or shards differ from those the run was started with."""


def check_resumable(run_id: str, archive: str, manifest: dict, kind: str, config_yaml: str,
                    fields: tuple[str, ...]) -> None:
    """Refuse a resume of a run of the other family (generate or evaluation) than ``kind``'s, or whose config
    differs from the one the run started with in any of ``fields`` (dotted)."""
    def field(config: dict, name: str):
        for key in name.split("."):
            config = config.get(key) if isinstance(config, dict) else None
        return config

    if (manifest.get("kind") == GENERATE) != (kind == GENERATE):
        raise ResumeError(f"run {run_id} in {archive} is a {manifest.get('kind')} run, and this config's kind is "
                          f"{kind}: resume it with a {manifest.get('kind')} config, or start a new run id")
    started, now = (yaml.safe_load(text or "") or {} for text in (manifest.get("config_yaml"), config_yaml))
    changed = [name for name in fields if field(started, name) != field(now, name)]
    if changed:
        raise ResumeError(
            f"run {run_id} was started with other {', '.join(changed)}: its files would not match this config's "
            f"requests and shards; resume it with the config it ran (kivi-eval query --archive {archive} \"SELECT "
            f"config_yaml FROM runs WHERE run_id = '{run_id}'\") or start a new run id")


def _plan(config: RunConfig, archive: ArchiveWriter, summary: RunSummary, tokenizer, fallbacks: dict[str, str]):
    caches = list(config.kivi_configs())
    shard_jobs, sweep_jobs, skipped, reused_sweeps = [], [], {}, 0
    workloads = config.build_workloads()
    if any(w.kind == "accuracy" for w in workloads.values()):
        summary.fallbacks = fallbacks
        for cache, reason in fallbacks.items():
            print(f"{cache}: generating with transformers.generate, not the decode engine: {reason}", flush=True)
    for name, workload in workloads.items():
        requests = workload_requests(workload, tokenizer, config.model.max_context)
        skipped[name] = dict(workload.skipped)
        if workload.skipped:
            reasons = "; ".join(f"{n} {reason}" for reason, n in sorted(workload.skipped.items()))
            print(f"{name}: {len(requests)} requests, {workload.skipped.total()} data records skipped ({reasons})",
                  flush=True)
        if workload.kind == "throughput":
            done = archive.perf_caches(name)
            sweep_jobs += [(name, requests, cache) for cache in caches if cache not in done]
            reused_sweeps += len(done.intersection(caches))
            continue
        done = {cache: archive.done_shards(name, cache) for cache in caches}
        for shard in make_shards(name, requests, config.ray.shard_size):
            todo = [c for c in caches if shard.index not in done[c]]
            summary.reused += len(caches) - len(todo)
            if todo:
                shard_jobs.append((shard, todo))
    pending = f"{sum(len(todo) for _, todo in shard_jobs)} shard × cache files and {len(sweep_jobs)} sweeps to compute"
    if summary.reused or reused_sweeps:
        print(f"resuming run {summary.run_id}: {summary.reused} shard × cache files and {reused_sweeps} sweeps reused "
              f"from the archive, {pending}", flush=True)
    else:
        print(f"run {summary.run_id}: {pending}", flush=True)
    if sweep_jobs and shard_jobs:
        print("sweeps are dispatched first, as they run longest; a single actor takes the shards after them", flush=True)
    return shard_jobs, sweep_jobs, skipped


def _execute(config: RunConfig, ctx: RunContext, shard_jobs, sweep_jobs, summary: RunSummary, progress: bool,
             in_process: bool) -> None:
    # Longest first: a sweep dispatched last would leave the other actors idle while it runs alone.
    jobs = [("run_sweep", job) for job in sweep_jobs] + [("run_shard", job) for job in shard_jobs]
    if not jobs:
        return
    counter = _Progress(files=sum(len(todo) for _, todo in shard_jobs), sweeps=len(sweep_jobs))
    for actor, (method, job), result in run_jobs(EvalWorker, ctx, config.ray, jobs, summary.placements, in_process):
        summary.placements[actor]["jobs"] += 1
        if method == "run_shard":
            summary.computed += [(job[0].workload, job[0].index, cache) for cache in job[1]]
        else:
            summary.sweeps.append(job[2])
        line = counter.shard(job[0], result) if method == "run_shard" else counter.sweep(job[0], job[2], result)
        if progress:
            print(line, flush=True)


class _Progress:
    """One line per finished job, counted against the plan's totals, with the time since the first job was sent."""

    def __init__(self, files: int, sweeps: int) -> None:
        self.files, self.sweeps, self.done_files, self.done_sweeps = files, sweeps, 0, 0
        self.began = time.perf_counter()

    def shard(self, shard: Shard, written: dict[str, dict]) -> str:
        self.done_files += len(written)
        caches = ", ".join(f"{cache} {w['seconds']:.1f} s" for cache, w in written.items()) or "already written"
        return f"{self._prefix()} {shard.workload} shard {shard.index} ({_count(len(shard.requests), 'request')}): {caches}"

    def sweep(self, workload: str, cache: str, rows: list[dict]) -> str:
        self.done_sweeps += 1
        timed = [r for r in rows if not r["oom"]]
        best = max(timed, key=lambda r: r["tokens_per_s"], default=None)
        result = (f"best {best['tokens_per_s']:.1f} tokens/s at batch {best['batch_size']}" if best else "OOM at every batch")
        return f"{self._prefix()} {workload} sweep {cache}: {result} ({_count(len(rows), 'timing')})"

    def _prefix(self) -> str:
        counts = [f"{done}/{total} {what}" for done, total, what in ((self.done_files, self.files, "shard × cache files"),
                                                                     (self.done_sweeps, self.sweeps, "sweeps")) if total]
        return f"[{', '.join(counts)}; {format_seconds(time.perf_counter() - self.began)}]"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def format_seconds(seconds: float) -> str:
    """"48.2 s", "11 min 17 s" or "2 h 5 min": what a person reads at a glance."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


Job = tuple[str, tuple]  # (the worker method, its arguments)


def run_jobs(worker_cls: type, ctx: RunContext, ray: RaySection, jobs: list[Job], placements: list[dict],
             in_process: bool) -> Iterator[tuple[int, Job, Any]]:
    """Run ``jobs`` on workers of ``worker_cls`` (a ModelWorker): Ray actors, or with ``in_process`` one worker in
    this process; yields (worker index, job, its result) as jobs finish. ``placements`` is filled in place, one
    entry per worker that came up."""
    if in_process:
        return _in_process(worker_cls, ctx, jobs, placements)
    return _on_ray(worker_cls, ctx, ray, jobs, placements)


def _started(placement: dict, requested: float, previous: dict) -> dict:
    """A worker's placement, its start-up seconds since ``requested`` (scheduling, imports, model load: paid once
    per actor, concurrently, so the part of a run that more GPUs cannot shorten), its job count and the jobs it
    lost (it died during them: each ran again on the next free actor), kept from ``previous`` across restarts."""
    return placement | {"ready_s": round(time.perf_counter() - requested, 1), "jobs": previous.get("jobs", 0),
                        "lost_jobs": previous.get("lost_jobs", 0)}


def _in_process(worker_cls: type, ctx: RunContext, jobs: list[Job], placements: list[dict]):
    """The same worker without Ray: one model load in this process, jobs in order (hosts without Ray, debugging)."""
    requested = time.perf_counter()
    worker = worker_cls(ctx)
    placements[:] = [_started(worker.placement(), requested, {})]
    for method, args in jobs:
        yield 0, (method, args), getattr(worker, method)(*args)


def _on_ray(worker_cls: type, ctx: RunContext, section: RaySection, jobs: list[Job], placements: list[dict]):
    """One actor per GPU (or CPU actors), each loading the model once; yields (actor, job, result) as jobs finish.

    A job whose actor died (its process, or its whole node) goes back to the front of the queue for the next free
    actor, on whatever node; Ray restarts the dead actor where resources allow, and it takes jobs again once up.
    """
    import ray

    if not ray.is_initialized():
        # Each local start warns that Ray turned on token auth, its default: a line per run that asks nothing.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        ray.init(address=section.address, log_to_driver=True)
    cluster = ray.cluster_resources()
    gpus = int(cluster.get("GPU", 0))
    n_actors = section.num_actors or max(gpus, 1)
    # Ray sets a CPU actor's torch threads to its num_cpus: without GPUs, actors split the cluster's cores.
    cpus = section.cpus_per_actor or max(int(cluster.get("CPU", 1)) // n_actors, 1)
    resources = dict(num_gpus=1) if gpus else dict(num_cpus=cpus)
    if section.resources:
        resources["resources"] = dict(section.resources)
    # No task retries inside Ray: they would wait for the dead actor's restart, forever where no node has room.
    actor_cls = ray.remote(max_restarts=section.max_retries, max_task_retries=0)(worker_cls)
    if CRASH_ONCE_ENV in os.environ:  # fault injection reaches actors of an already running cluster too
        resources["runtime_env"] = {"env_vars": {CRASH_ONCE_ENV: os.environ[CRASH_ONCE_ENV]}}
    requested = time.perf_counter()
    actors = [actor_cls.options(**resources).remote(ctx) for _ in range(n_actors)]
    starting = {}  # probe ref -> actor index; each actor's placement is stamped as it comes up
    placements[:] = [{} for _ in actors]
    queue, idle, running, losses, deaths = list(enumerate(jobs)), [], {}, [0] * len(jobs), [0] * n_actors
    last_death = RuntimeError("every actor died and Ray restarts none")

    def probe(index: int) -> None:  # answered once the actor is up (again), with where it runs
        starting[actors[index].placement.remote()] = index

    def died(index: int) -> None:  # Ray restarts it until its restarts are spent; it rejoins the pool once up
        deaths[index] += 1
        if deaths[index] <= section.max_retries:
            probe(index)

    for index in range(n_actors):
        probe(index)
    try:
        while queue or running:
            while queue and idle:
                number, (method, args) = queue.pop(0)
                index = idle.pop()
                running[getattr(actors[index], method).remote(*args)] = (index, number)
            if not (running or starting):
                raise last_death  # no actor left to run the queue: the run stops, a rerun resumes
            (ref,), _ = ray.wait([*starting, *running], num_returns=1)
            if ref in starting:
                index = starting.pop(ref)
                try:
                    placement = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    last_death = err
                    died(index)
                    continue
                placements[index] = _started(placement, requested, placements[index])
                idle.append(index)
                continue
            index, number = running.pop(ref)
            try:
                result = ray.get(ref)  # re-raises a job's own error: the run stops, a rerun resumes
            except ray.exceptions.RayActorError:
                losses[number] += 1
                if losses[number] > section.max_retries:
                    raise
                placements[index]["lost_jobs"] += 1
                queue.insert(0, (number, jobs[number]))
                died(index)
                continue
            idle.append(index)
            yield index, jobs[number], result
    finally:
        for actor in actors:
            ray.kill(actor)
        placements[:] = [p for p in placements if p]  # an actor that never came up ran nothing


def check_model(config) -> dict[str, str]:
    """Every cache of a run or generate config against the model, from its config alone (its modules on the meta
    device), before any weights load: a KIVI cache the model cannot hold, a context past the model's positions, or a
    generate run's new tokens filling the context, is a ConfigError naming the field. Returns the caches whose
    generations go through transformers.generate, and why; prints a line for a KIVI cache that would quantize nothing
    on this model."""
    model_config = load_model_config(config.model.spec)
    text = model_config.get_text_config(decoder=True)
    if config.model.dtype == "float16" and text.model_type in FP16_OVERFLOWS:
        raise ConfigError(f"model.dtype: float16 overflows {config.model.spec}'s activations ({text.model_type}: its "
                          "logits come out NaN); set bfloat16, or auto (bfloat16 for it on GPUs)")
    positions, context = getattr(text, "max_position_embeddings", None), config.model.max_context
    if positions and context and context > positions:
        raise ConfigError(f"model.max_context: {context} tokens is past the {positions} positions of "
                          f"{config.model.spec}; lower it to {positions} or less")
    new_tokens, room = getattr(config, "max_new_tokens", None), context or positions  # a generate run's, every row's
    if new_tokens and room and new_tokens >= room:
        raise ConfigError(f"max_new_tokens (--max-new-tokens): {new_tokens} new tokens a row leave no room for a "
                          f"prompt in the {room}-token context of {config.model.spec}; lower it")
    layers = attention_layers(text) if unsupported_layout(text) is None else []
    for name, kivi in config.kivi_configs().items():
        if kivi is None:
            continue
        try:
            check_fits_model(kivi, text)
        except KiviConfigError as err:
            raise ConfigError(f"caches: {name} cannot hold {config.model.spec}: {err}") from None
        if all(layer.sliding for layer in layers):
            print(f"{name}: every attention layer of {config.model.spec} slides over a window (of {layers[0].window} "
                  f"tokens), which KIVI caches keep in 16 bits: this cache quantizes nothing on this model", flush=True)
    try:
        model = meta_model(model_config)
    except ValueError as err:  # transformers builds no causal LM of this config (an encoder-decoder, say)
        raise ConfigError(f"model.spec: {config.model.spec} is not a decoder-only model transformers can build: "
                          f"{str(err).splitlines()[0]}") from None
    return {name: reason for name, kivi in config.kivi_configs().items() if (reason := fallback_reason(model, kivi))}


def _check_sweeps(config: RunConfig, fallbacks: dict[str, str]) -> None:
    """A throughput sweep runs on the decode engine: every cache must be one it drives on this model."""
    sweeps = [name for name, w in config.build_workloads().items() if w.kind == "throughput"]
    if sweeps and fallbacks:
        name, reason = next(iter(fallbacks.items()))
        raise ConfigError(f"workloads.{sweeps[0]}: the sweep runs on the decode engine, which cannot run {name}: {reason}")


def workload_requests(workload: Workload, tokenizer, max_context: int) -> list[Request]:
    """The workload's requests, each checked to fit ``max_context`` as the engine will feed it to the model."""
    requests = workload.requests(tokenizer, max_context)
    if workload.kind != "teacher_forced":  # the engine cuts those to teacher_forcing.tokens <= max_context token ids
        check_budget(requests, tokenizer, max_context)
    return requests


def describe_failure(err: BaseException) -> str:
    """One line for a run's failure: the exception's type and first line (a Ray task error: its worker's)."""
    cause = getattr(err, "cause", None) or err  # ray.exceptions.RayTaskError carries the actor's exception
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def _git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _versions() -> dict[str, str]:
    versions = {}
    for package in ("torch", "transformers", "triton", "ray"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "absent"
    digest = hashlib.sha256()
    for source in sorted([*KERNELS_DIR.glob("*.py"), *KERNELS_DIR.glob("csrc/*")]):  # Triton's and the CUDA source
        digest.update(source.read_bytes())
    versions["kernels"] = digest.hexdigest()[:12]  # canaries gate kernel changes by this hash
    return versions
