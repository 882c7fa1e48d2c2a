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
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.archive import ArchiveWriter
from pipeline.config import RunConfig
from pipeline.engine import fallback_reason
from pipeline.errors import InputError
from pipeline.models import load_model_config, load_tokenizer, meta_model
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
        _check_resumable(run_id, manifest["config_yaml"], config_yaml)
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.spec)  # a bad spec fails before the first write
    started = manifest["started_at"] if manifest else dt.datetime.now(dt.UTC)
    ctx = RunContext(run_id, config, started, _git_sha())
    if manifest is None:
        archive.write_run(dict(kind=config.kind, label=config.label, model=config.model.spec, git_sha=ctx.git_sha, config_yaml=config_yaml,
                               baseline_run_id=config.baseline_run_id, started_at=started, versions=_versions()))
    else:
        archive.update_run_status("running")
    summary, skipped = RunSummary(run_id), None
    try:
        shard_jobs, sweep_jobs, skipped = _plan(config, archive, summary, tokenizer)
        if summary.fallbacks:  # kept from the start: a killed driver's manifest says it too
            archive.update_run_status("running", fallbacks=summary.fallbacks)
        _execute(config, ctx, shard_jobs, sweep_jobs, summary, progress, in_process)
    except BaseException as err:  # an interrupt too: the manifest never stays "running" after the driver is gone
        archive.update_run_status("failed", skipped=skipped, placements=summary.placements, fallbacks=summary.fallbacks,
                                  error=describe_failure(err))
        raise
    archive.update_run_status("complete", skipped=skipped, placements=summary.placements, fallbacks=summary.fallbacks)
    return summary


# What decides a run's requests, shards and caches: a resume under other values would take the files of one
# layout for another (shard 0 of 256 requests counted as done for shard 0 of 25).
_RESUME_FIELDS = ("model", "caches", "cache_overrides", "workloads", "generation", "sweep", "ray.shard_size")


class ResumeError(InputError):
    """A run id resumed with a config whose requests or shards differ from those the run was started with."""


def _check_resumable(run_id: str, started_yaml: str | None, config_yaml: str) -> None:
    def field(config: dict, name: str):
        for key in name.split("."):
            config = config.get(key) if isinstance(config, dict) else None
        return config

    started, now = (yaml.safe_load(text or "") or {} for text in (started_yaml, config_yaml))
    changed = [name for name in _RESUME_FIELDS if field(started, name) != field(now, name)]
    if changed:
        raise ResumeError(
            f"run {run_id} was started with other {', '.join(changed)}: its files would not match this config's "
            f"requests and shards; resume it with the config it ran (kivi-eval query \"SELECT config_yaml FROM runs "
            f"WHERE run_id = '{run_id}'\") or start a new run id")


def _plan(config: RunConfig, archive: ArchiveWriter, summary: RunSummary, tokenizer):
    caches = list(config.kivi_configs())
    shard_jobs, sweep_jobs, skipped, reused_sweeps = [], [], {}, 0
    workloads = config.build_workloads()
    if any(w.kind == "accuracy" for w in workloads.values()):
        summary.fallbacks = generation_fallbacks(config)
        for cache, reason in summary.fallbacks.items():
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
    jobs = [("sweep", job) for job in sweep_jobs] + [("shard", job) for job in shard_jobs]
    if not jobs:
        return
    counter = _Progress(files=sum(len(todo) for _, todo in shard_jobs), sweeps=len(sweep_jobs))
    finished = _in_process(ctx, jobs, summary) if in_process else _on_ray(config, ctx, jobs, summary)
    for actor, kind, job, result in finished:
        summary.placements[actor]["jobs"] += 1
        if kind == "shard":
            summary.computed += [(job[0].workload, job[0].index, cache) for cache in job[1]]
        else:
            summary.sweeps.append(job[2])
        line = counter.shard(job[0], result) if kind == "shard" else counter.sweep(job[0], job[2], result)
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


def _started(placement: dict, requested: float, previous: dict) -> dict:
    """A worker's placement, its start-up seconds since ``requested`` (scheduling, imports, model load: paid once
    per actor, concurrently, so the part of a run that more GPUs cannot shorten), its job count and the jobs it
    lost (it died during them: each ran again on the next free actor), kept from ``previous`` across restarts."""
    return placement | {"ready_s": round(time.perf_counter() - requested, 1), "jobs": previous.get("jobs", 0),
                        "lost_jobs": previous.get("lost_jobs", 0)}


def _in_process(ctx: RunContext, jobs: list, summary: RunSummary):
    """The same worker without Ray: one model load in this process, jobs in order (hosts without Ray, debugging)."""
    requested = time.perf_counter()
    worker = EvalWorker(ctx)
    summary.placements = [_started(worker.placement(), requested, {})]
    for kind, job in jobs:
        yield 0, kind, job, worker.run_shard(*job) if kind == "shard" else worker.run_sweep(*job)


def _on_ray(config: RunConfig, ctx: RunContext, jobs: list, summary: RunSummary):
    """One actor per GPU (or CPU actors), each loading the model once; yields (actor, kind, job, its result) as jobs
    finish.

    A job whose actor died (its process, or its whole node) goes back to the front of the queue for the next free
    actor, on whatever node; Ray restarts the dead actor where resources allow, and it takes jobs again once up.
    """
    import ray

    if not ray.is_initialized():
        # Each local start warns that Ray turned on token auth, its default: a line per run that asks nothing.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        ray.init(address=config.ray.address, log_to_driver=True)
    cluster = ray.cluster_resources()
    gpus = int(cluster.get("GPU", 0))
    n_actors = config.ray.num_actors or max(gpus, 1)
    # Ray sets a CPU actor's torch threads to its num_cpus: without GPUs, actors split the cluster's cores.
    cpus = config.ray.cpus_per_actor or max(int(cluster.get("CPU", 1)) // n_actors, 1)
    resources = dict(num_gpus=1) if gpus else dict(num_cpus=cpus)
    if config.ray.resources:
        resources["resources"] = dict(config.ray.resources)
    # No task retries inside Ray: they would wait for the dead actor's restart, forever where no node has room.
    actor_cls = ray.remote(max_restarts=config.ray.max_retries, max_task_retries=0)(EvalWorker)
    if CRASH_ONCE_ENV in os.environ:  # fault injection reaches actors of an already running cluster too
        resources["runtime_env"] = {"env_vars": {CRASH_ONCE_ENV: os.environ[CRASH_ONCE_ENV]}}
    requested = time.perf_counter()
    actors = [actor_cls.options(**resources).remote(ctx) for _ in range(n_actors)]
    starting = {}  # probe ref -> actor index; each actor's placement is stamped as it comes up
    summary.placements = [{} for _ in actors]
    queue, idle, running, losses, deaths = list(enumerate(jobs)), [], {}, [0] * len(jobs), [0] * n_actors
    last_death = RuntimeError("every actor died and Ray restarts none")

    def probe(index: int) -> None:  # answered once the actor is up (again), with where it runs
        starting[actors[index].placement.remote()] = index

    def died(index: int) -> None:  # Ray restarts it until its restarts are spent; it rejoins the pool once up
        deaths[index] += 1
        if deaths[index] <= config.ray.max_retries:
            probe(index)

    for index in range(n_actors):
        probe(index)
    try:
        while queue or running:
            while queue and idle:
                number, (kind, job) = queue.pop(0)
                index = idle.pop()
                actor = actors[index]
                ref = actor.run_shard.remote(*job) if kind == "shard" else actor.run_sweep.remote(*job)
                running[ref] = (index, number)
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
                summary.placements[index] = _started(placement, requested, summary.placements[index])
                idle.append(index)
                continue
            index, number = running.pop(ref)
            try:
                result = ray.get(ref)  # re-raises a job's own error: the run stops, a rerun resumes
            except ray.exceptions.RayActorError:
                losses[number] += 1
                if losses[number] > config.ray.max_retries:
                    raise
                summary.placements[index]["lost_jobs"] += 1
                queue.insert(0, (number, jobs[number]))
                died(index)
                continue
            idle.append(index)
            yield index, *jobs[number], result
    finally:
        for actor in actors:
            ray.kill(actor)
        summary.placements = [p for p in summary.placements if p]  # an actor that never came up ran nothing


def generation_fallbacks(config: RunConfig) -> dict[str, str]:
    """Caches whose generations go through transformers.generate, and why; decided from the model's config alone
    (its modules on the meta device), before any weights load."""
    model = meta_model(load_model_config(config.model.spec))
    return {name: reason for name, kivi in config.kivi_configs().items() if (reason := fallback_reason(model, kivi))}


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
    for source in sorted(KERNELS_DIR.glob("*.py")):
        digest.update(source.read_bytes())
    versions["kernels"] = digest.hexdigest()[:12]  # canaries gate kernel changes by this hash
    return versions
