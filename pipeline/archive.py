"""Parquet archive: table schemas, the hive-partitioned layout, and atomic per-shard writes.

Layout under the archive root (partition columns live in the path only, as hive expects):

    results/run_id=<id>/workload=<w>/cache=<c>/shard-<NNNNN>.parquet
    generations/run_id=<id>/cache=<c>/shard-<NNNNN>.parquet      kivi-eval generate: one row per input row
    openai/run_id=<id>/<c>.jsonl                                  … and its OpenAI batch results, for such input
    perf/run_id=<id>/workload=<w>/cache=<c>/batch-<NNNNN>.parquet
    runs/run_id=<id>/run.parquet
    verdicts/run_id=<id>/rules-<rules>.parquet    one per rules file (<rules>: its name without .yaml)

Archives written before verdicts were kept per rules file hold ``verdicts/run_id=<id>/verdicts.parquet``;
it reads as verdicts whose ``rules`` is null.

The root is a folder or a URI (``pipeline.archive_root``). Every file is written whole (a rename in a folder,
one upload in an object store): readers see the old file or the new one, never part of one; a rerun of a shard
replaces its file, and a crashed write leaves nothing that a ``*.parquet`` pattern matches.

Two drivers of one run id (a rerun started while the first still runs) write the same deterministic shard × cache
files, so the archive holds each once whatever their order. The manifest is read, changed and written whole by
each status update: it always holds one driver's complete row, and of two updates racing, the later write wins
(object stores offer no compare-and-swap through pyarrow); a finished driver's rerun of the run id restores it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.archive_root import ArchiveRoot, open_root
from pipeline.names import RUN_KINDS

RUN_STATUSES = ("running", "complete", "failed")

_TS = pa.timestamp("us", tz="UTC")
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # survives hive path parsing unescaped


class ArchiveError(ValueError):
    """Rows or names that cannot go into the archive; the message names the table and column."""


@dataclass(frozen=True)
class TableSpec:
    """One archive table: its logical columns, which of them are path partitions, and where files live."""

    name: str
    schema: pa.Schema
    partitions: tuple[str, ...]
    required: tuple[str, ...]
    glob: str  # relative to the root; matches final files only, never `.tmp-` ones
    json_columns: tuple[str, ...] = ()  # dicts/lists given for these are stored as JSON text

    @property
    def file_schema(self) -> pa.Schema:
        return pa.schema([f for f in self.schema if f.name not in self.partitions])


RESULTS = TableSpec(
    name="results",
    schema=pa.schema([
        ("run_id", pa.string()), ("started_at", _TS), ("git_sha", pa.string()), ("model", pa.string()),
        ("workload", pa.string()), ("workload_version", pa.int32()), ("task", pa.string()),
        ("request_id", pa.string()), ("shard", pa.int32()), ("cache", pa.string()),
        # Null for fp16: it has no quantization parameters.
        ("k_bits", pa.int32()), ("v_bits", pa.int32()), ("group_size", pa.int32()), ("residual_length", pa.int32()),
        ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32()),
        ("prediction", pa.string()), ("reference", pa.string()),
        ("score", pa.float64()),  # a fraction in [0, 1] for every metric; null when `error` is set
        ("metric", pa.string()), ("latency_s", pa.float64()), ("error", pa.string()),
        ("meta", pa.string()),  # JSON; NIAH cells carry {"context_length": int, "depth": fraction in [0, 1]}
    ]),
    partitions=("run_id", "workload", "cache"),
    required=("run_id", "model", "workload", "workload_version", "task", "request_id", "shard", "cache"),
    glob="results/*/*/*/*.parquet",
    json_columns=("reference", "meta"),  # LongBench references are lists of answers
)

GENERATIONS = TableSpec(
    name="generations",
    schema=pa.schema([
        ("run_id", pa.string()), ("started_at", _TS), ("model", pa.string()), ("cache", pa.string()),
        ("shard", pa.int32()),
        ("row", pa.int64()),  # the input row's number (files in path order, rows in file order): the key
        ("id", pa.string()),  # the row's id (custom_id in the OpenAI batch format); null where it has none
        ("prompt_hash", pa.string()),  # of the prompt as the model read it (chat template applied): 16 hex digits
        ("prompt_tokens", pa.int32()),
        ("output_text", pa.string()), ("output_token_ids", pa.list_(pa.int32())), ("output_tokens", pa.int32()),
        ("finish_reason", pa.string()),  # eos, stop or length; null on an error row
        ("max_new_tokens", pa.int32()),
        ("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int32()), ("seed", pa.int64()),
        ("latency_s", pa.float64()),  # from the row's prefill to its last token
        ("shard_s", pa.float64()),  # seconds its shard × cache took on the actor (the same on each of its rows)
        ("kl_to_fp16", pa.float64()),  # --score-kl, KIVI rows: mean KL(fp16 || cache) along the row's own output
        ("error_code", pa.string()),  # duplicate_id, empty_prompt, prompt_too_long, out_of_memory, …; null: generated
        ("error", pa.string()),
    ]),
    partitions=("run_id", "cache"),
    required=("run_id", "model", "cache", "shard", "row"),
    glob="generations/*/*/*.parquet",
)

PERF = TableSpec(
    name="perf",
    schema=pa.schema([
        ("run_id", pa.string()), ("model", pa.string()), ("cache", pa.string()), ("workload", pa.string()),
        ("batch_size", pa.int32()), ("repeat", pa.int32()),  # repeat: which timing of the point (sweep.repeats)
        ("prompt_len", pa.int32()), ("gen_len", pa.int32()),
        ("tokens_per_s", pa.float64()),  # generated tokens / (prefill + decode time)
        ("decode_tokens_per_s", pa.float64()), ("step_ms", pa.float64()), ("prefill_s", pa.float64()),
        ("peak_mem_bytes", pa.int64()), ("kv_bytes", pa.int64()),
        ("fp16_kv_bytes", pa.int64()), ("oom", pa.bool_()), ("device", pa.string()),
    ]),
    partitions=("run_id", "workload", "cache"),
    required=("run_id", "cache", "workload", "batch_size", "oom"),
    glob="perf/*/*/*/*.parquet",
)

RUNS = TableSpec(
    name="runs",
    schema=pa.schema([
        ("run_id", pa.string()), ("kind", pa.string()),
        ("label", pa.string()),  # the run's series (config `label`, default its kind); null in manifests from before
        ("model", pa.string()), ("git_sha", pa.string()),
        ("config_yaml", pa.string()), ("baseline_run_id", pa.string()), ("status", pa.string()),
        ("started_at", _TS), ("finished_at", _TS),
        ("versions", pa.string()),  # JSON: torch, transformers, triton, kernel hash
        ("skipped", pa.string()),  # JSON: {workload: {reason: count}} of malformed records left out
        ("placements", pa.string()),  # JSON: per actor host, pid, device, Ray GPU ids, GPU UUID, start-up seconds, jobs finished
        ("error", pa.string()),  # why a failed run stopped (exception type and message); null otherwise
        ("fallbacks", pa.string()),  # JSON: {cache: why its generations ran through transformers.generate}
        # JSON, kivi-eval generate runs: the input (source, format, files, rows, shards, fingerprint) and, once the
        # run ends, rows and output tokens per cache and its error rows per error_code.
        ("generation", pa.string()),
    ]),
    partitions=("run_id",),
    required=("run_id", "kind", "status", "started_at"),
    glob="runs/*/run.parquet",
    json_columns=("versions", "skipped", "placements", "fallbacks", "generation"),
)

VERDICTS = TableSpec(
    name="verdicts",
    schema=pa.schema([
        ("run_id", pa.string()),
        ("rules", pa.string()), ("rules_path", pa.string()),  # the rules file's name (without .yaml) and path as given
        ("rule", pa.string()), ("kind", pa.string()),
        ("workload", pa.string()),  # the rule's workload; null for rules over every workload (baseline rules)
        ("cache", pa.string()), ("baseline_run_id", pa.string()), ("observed", pa.float64()), ("threshold", pa.float64()),
        ("passed", pa.bool_()), ("detail", pa.string()),
        # Interval rules: paired requests, the interval of `observed` at the rule's confidence, p, detectable effect.
        ("n", pa.int64()), ("ci_low", pa.float64()), ("ci_high", pa.float64()), ("p_value", pa.float64()),
        ("mde", pa.float64()),
    ]),
    partitions=("run_id",),
    required=("run_id", "rules", "rule", "kind", "passed"),
    glob="verdicts/*/*.parquet",
)

TABLES: dict[str, TableSpec] = {t.name: t for t in (RESULTS, PERF, RUNS, VERDICTS, GENERATIONS)}


def to_table(spec: TableSpec, rows: Iterable[dict[str, Any]]) -> pa.Table:
    """Rows as a table of ``spec.schema``; unknown keys, lossy casts and missing required values raise."""
    rows = list(rows)
    for i, row in enumerate(rows):
        unknown = set(row) - set(spec.schema.names)
        if unknown:
            raise ArchiveError(f"{spec.name} row {i}: unknown column(s) {sorted(unknown)}; columns: {spec.schema.names}")
    columns = {}
    for field in spec.schema:
        values = [_encode(row.get(field.name)) if field.name in spec.json_columns else row.get(field.name) for row in rows]
        try:
            # Infer, then cast safely: pyarrow's direct conversion would truncate 1.5 into an int column.
            columns[field.name] = pa.array(values).cast(field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise ArchiveError(f"{spec.name}.{field.name}: {e}") from e
        if field.name in spec.required and columns[field.name].null_count:
            raise ArchiveError(f"{spec.name}.{field.name} is required but missing in {columns[field.name].null_count} row(s)")
    return pa.table(columns, schema=spec.schema)


# An object replaced while it is read can come back as a mix of the old and the new one: pyarrow's S3 reads ask the
# size first and then for that many bytes. Only a manifest is replaced while readers look (two drivers racing).
_READ_ATTEMPTS = 3


def read_table(root: ArchiveRoot, relative: str, spec: TableSpec) -> pa.Table:
    """One archive file with its partition columns restored from the path (``key=value`` folders)."""
    for attempt in range(_READ_ATTEMPTS):
        try:
            table = pq.read_table(pa.BufferReader(root.read(relative)))
            break
        except (pa.ArrowInvalid, OSError):  # a torn read fails Parquet's footer or metadata checks
            if attempt == _READ_ATTEMPTS - 1:
                raise
    parts = dict(p.split("=", 1) for p in relative.split("/")[:-1] if "=" in p)
    for name in spec.partitions:
        table = table.append_column(name, pa.array([parts[name]] * table.num_rows, pa.string()))
    for field in spec.schema:  # a column added after the file was written reads as null
        if field.name not in table.column_names:
            table = table.append_column(field.name, pa.nulls(table.num_rows, field.type))
    return table.select(spec.schema.names).cast(spec.schema)


def _encode(value: Any) -> Any:
    return value if value is None or isinstance(value, str) else json.dumps(value, sort_keys=True)


def _segment(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _SEGMENT.fullmatch(value):
        raise ArchiveError(f"{kind}={value!r} must match {_SEGMENT.pattern} (it becomes a folder name)")
    return f"{kind}={value}"


def write_whole(root: ArchiveRoot, relative: str, table: pa.Table) -> str:
    """Write ``table`` as Parquet to ``relative`` so that a reader or a crash never sees a partial file.

    The file is built in memory first: a failure while encoding it leaves the archive untouched."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return root.write(relative, sink.getvalue())


class ArchiveWriter:
    """Writes one run's files under ``root`` (a folder or a URI); safe to use from several processes and nodes on
    different shards. Paths are relative to the root; written files are returned as their location."""

    def __init__(self, root: str | os.PathLike[str] | ArchiveRoot, run_id: str) -> None:
        self.root = open_root(root)
        self.run_id = run_id
        self._run_dir = _segment("run_id", run_id)

    def results_dir(self, workload: str, cache: str) -> str:
        return f"results/{self._run_dir}/{_segment('workload', workload)}/{_segment('cache', cache)}"

    def generations_dir(self, cache: str) -> str:
        return f"generations/{self._run_dir}/{_segment('cache', cache)}"

    def openai_results_path(self, cache: str) -> str:
        return f"openai/{self._run_dir}/{_segment('cache', cache).removeprefix('cache=')}.jsonl"

    def shard_path(self, workload: str, cache: str, shard: int) -> str:
        return _shard_file(self.results_dir(workload, cache), shard)

    def write_results(self, workload: str, cache: str, shard: int, rows: list[dict[str, Any]]) -> str:
        """Write (or replace, whole) the file of one shard × cache configuration."""
        fixed = {"run_id": self.run_id, "workload": workload, "cache": cache, "shard": shard}
        # A workload with a single task names it after itself, so per-task views never join on NULL.
        filled = [{**row, "task": row.get("task") or workload} for row in rows]
        return self._write_shard(RESULTS, self.results_dir(workload, cache), shard, filled, fixed)

    def write_generations(self, cache: str, shard: int, rows: list[dict[str, Any]]) -> str:
        """Write (or replace, whole) the generations of one input shard under one cache."""
        fixed = {"run_id": self.run_id, "cache": cache, "shard": shard}
        return self._write_shard(GENERATIONS, self.generations_dir(cache), shard, rows, fixed)

    def _write_shard(self, spec: TableSpec, folder: str, shard: int, rows: list[dict[str, Any]], fixed: dict) -> str:
        table = to_table(spec, [_with_partition(spec, row, fixed) for row in rows])
        return write_whole(self.root, _shard_file(folder, shard), table.select(spec.file_schema.names))

    def has_results(self, workload: str, cache: str, shard: int) -> bool:
        return self.root.exists(self.shard_path(workload, cache, shard))

    def has_generations(self, cache: str, shard: int) -> bool:
        return self.root.exists(_shard_file(self.generations_dir(cache), shard))

    def done_shards(self, workload: str, cache: str) -> set[int]:
        """Shards of this workload × cache already in the archive: what a resumed run may skip."""
        return self._done(self.results_dir(workload, cache))

    def done_generation_shards(self, cache: str) -> set[int]:
        """Input shards whose generations under ``cache`` are already in the archive."""
        return self._done(self.generations_dir(cache))

    def _done(self, folder: str) -> set[int]:
        files = self.root.glob(f"{folder}/shard-*.parquet")
        return {int(f.rsplit("/", 1)[1].removeprefix("shard-").removesuffix(".parquet")) for f in files}

    def perf_caches(self, workload: str) -> set[str]:
        """Caches whose throughput sweep of this workload is already in the archive."""
        files = self.root.glob(f"perf/{self._run_dir}/{_segment('workload', workload)}/cache=*/*.parquet")
        return {f.split("/")[3].removeprefix("cache=") for f in files}

    def write_perf(self, rows: list[dict[str, Any]]) -> list[str]:
        """Write perf rows, one file per workload × cache × batch size (a rerun of a point replaces it)."""
        groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        for row in rows:
            row = _with_partition(PERF, row, {"run_id": self.run_id})
            groups.setdefault((row.get("workload"), row.get("cache"), row.get("batch_size")), []).append(row)
        paths = []
        for (workload, cache, batch), group in groups.items():
            table = to_table(PERF, group)  # validates before the file name is built from these values
            path = f"perf/{self._run_dir}/{_segment('workload', workload)}/{_segment('cache', cache)}/batch-{int(batch):05d}.parquet"
            paths.append(write_whole(self.root, path, table.select(PERF.file_schema.names)))
        return paths

    @property
    def run_path(self) -> str:
        return f"runs/{self._run_dir}/run.parquet"

    def write_run(self, manifest: dict[str, Any]) -> str:
        """Write the run's manifest row; status defaults to running and started_at to now."""
        row = _with_partition(RUNS, {"status": "running", "started_at": _now(), **manifest}, {"run_id": self.run_id})
        _check_choice("runs.kind", row.get("kind"), RUN_KINDS)
        _check_choice("runs.status", row.get("status"), RUN_STATUSES)
        return write_whole(self.root, self.run_path, to_table(RUNS, [row]).select(RUNS.file_schema.names))

    def read_run(self) -> dict[str, Any] | None:
        """The manifest row as written (JSON columns still text), or None before `write_run`."""
        if not self.root.exists(self.run_path):
            return None
        return read_table(self.root, self.run_path, RUNS).to_pylist()[0]

    def update_run_status(
        self,
        status: str,
        *,
        finished_at: dt.datetime | None = None,
        skipped: dict[str, dict[str, int]] | None = None,
        placements: list[dict[str, Any]] | None = None,
        fallbacks: dict[str, str] | None = None,
        generation: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> str:
        """Set the status; a final one stamps finished_at (now unless given); skipped, placements, fallbacks and
        generation replace theirs; ``error`` is kept with a failed status only (a resumed run clears it)."""
        row = self.read_run()
        if row is None:
            raise ArchiveError(f"run {self.run_id!r} has no manifest under {self.root}; call write_run first")
        row["status"] = status
        row["finished_at"] = None if status == "running" else finished_at or _now()  # a resumed run is unfinished
        row["error"] = error if status == "failed" else None
        if skipped is not None:
            row["skipped"] = skipped
        if placements:
            row["placements"] = placements
        if fallbacks is not None:
            row["fallbacks"] = fallbacks
        if generation is not None:
            row["generation"] = generation
        return self.write_run(row)

    def write_verdicts(self, rules: str, rows: list[dict[str, Any]]) -> str:
        """Replace the run's verdicts of one rules file (re-evaluating it supersedes them; other files' stay)."""
        fixed = {"run_id": self.run_id, "rules": rules}
        table = to_table(VERDICTS, [_with_partition(VERDICTS, row, fixed) for row in rows])
        path = f"verdicts/{self._run_dir}/rules-{re.sub(r'[^A-Za-z0-9._+-]', '_', rules)}.parquet"
        return write_whole(self.root, path, table.select(VERDICTS.file_schema.names))


def _shard_file(folder: str, shard: int) -> str:
    return f"{folder}/shard-{shard:05d}.parquet"


def _with_partition(spec: TableSpec, row: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """The row with the values its file path implies; a row that contradicts its path is a caller bug."""
    for name, value in fixed.items():
        if row.get(name) not in (None, value):
            raise ArchiveError(f"{spec.name}.{name}={row[name]!r} contradicts the file it is written to ({name}={value!r})")
    return {**row, **fixed}


def _check_choice(where: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ArchiveError(f"{where}={value!r}; use one of {choices}")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
