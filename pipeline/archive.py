"""Parquet archive: table schemas, the hive-partitioned layout, and atomic per-shard writes.

Layout under the archive root (partition columns live in the path only, as hive expects):

    results/run_id=<id>/workload=<w>/cache=<c>/shard-<NNNNN>.parquet
    perf/run_id=<id>/workload=<w>/cache=<c>/batch-<NNNNN>.parquet
    runs/run_id=<id>/run.parquet
    verdicts/run_id=<id>/rules-<rules>.parquet    one per rules file (<rules>: its name without .yaml)

Archives written before verdicts were kept per rules file hold ``verdicts/run_id=<id>/verdicts.parquet``;
it reads as verdicts whose ``rules`` is null.

Every file is written to ``<name>.tmp-<uuid>`` in its final folder, fsynced and renamed with
``os.replace``: readers see either the old file or the new one, a rerun of a shard replaces it, and a
crashed write leaves only a ``.tmp-`` file that no ``*.parquet`` glob matches.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

RUN_KINDS = ("nightly", "canary", "smoke")
RUN_STATUSES = ("running", "complete", "failed")
FP16 = "fp16"  # the `cache` value of the unquantized baseline in every run

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
        ("run_id", pa.string()), ("kind", pa.string()), ("model", pa.string()), ("git_sha", pa.string()),
        ("config_yaml", pa.string()), ("baseline_run_id", pa.string()), ("status", pa.string()),
        ("started_at", _TS), ("finished_at", _TS),
        ("versions", pa.string()),  # JSON: torch, transformers, triton, kernel hash
        ("skipped", pa.string()),  # JSON: {workload: {reason: count}} of malformed records left out
        ("placements", pa.string()),  # JSON: per actor host, pid, device, Ray GPU ids, GPU UUID, start-up seconds, jobs finished
        ("error", pa.string()),  # why a failed run stopped (exception type and message); null otherwise
        ("fallbacks", pa.string()),  # JSON: {cache: why its generations ran through transformers.generate}
    ]),
    partitions=("run_id",),
    required=("run_id", "kind", "status", "started_at"),
    glob="runs/*/run.parquet",
    json_columns=("versions", "skipped", "placements", "fallbacks"),
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

TABLES: dict[str, TableSpec] = {t.name: t for t in (RESULTS, PERF, RUNS, VERDICTS)}


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


def read_table(path: Path, spec: TableSpec) -> pa.Table:
    """One archive file with its partition columns restored from the path (``key=value`` folders)."""
    table = pq.read_table(path)
    parts = dict(p.split("=", 1) for p in path.parent.parts if "=" in p)
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


def write_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` so that a reader or a crash never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    # The rename itself is durable only once the directory entry is synced.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ArchiveWriter:
    """Writes one run's files under ``root``; safe to use from several processes on different shards."""

    def __init__(self, root: str | os.PathLike[str], run_id: str) -> None:
        self.root = Path(root)
        self.run_id = run_id
        self._run_dir = _segment("run_id", run_id)

    def results_dir(self, workload: str, cache: str) -> Path:
        return self.root / "results" / self._run_dir / _segment("workload", workload) / _segment("cache", cache)

    def write_results(self, workload: str, cache: str, shard: int, rows: list[dict[str, Any]]) -> Path:
        """Write (or atomically replace) the file of one shard × cache configuration."""
        fixed = {"run_id": self.run_id, "workload": workload, "cache": cache, "shard": shard}
        # A workload with a single task names it after itself, so per-task views never join on NULL.
        filled = [{**row, "task": row.get("task") or workload} for row in rows]
        table = to_table(RESULTS, [_with_partition(RESULTS, row, fixed) for row in filled])
        path = self.results_dir(workload, cache) / f"shard-{shard:05d}.parquet"
        write_atomic(table.select(RESULTS.file_schema.names), path)
        return path

    def done_shards(self, workload: str, cache: str) -> set[int]:
        """Shards of this workload × cache already in the archive: what a resumed run may skip."""
        folder = self.results_dir(workload, cache)
        return {int(p.stem.removeprefix("shard-")) for p in folder.glob("shard-*.parquet")}

    def perf_caches(self, workload: str) -> set[str]:
        """Caches whose throughput sweep of this workload is already in the archive."""
        folder = self.root / "perf" / self._run_dir / _segment("workload", workload)
        return {p.name.removeprefix("cache=") for p in folder.glob("cache=*") if any(p.glob("*.parquet"))}

    def write_perf(self, rows: list[dict[str, Any]]) -> list[Path]:
        """Write perf rows, one file per workload × cache × batch size (a rerun of a point replaces it)."""
        groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        for row in rows:
            row = _with_partition(PERF, row, {"run_id": self.run_id})
            groups.setdefault((row.get("workload"), row.get("cache"), row.get("batch_size")), []).append(row)
        paths = []
        for (workload, cache, batch), group in groups.items():
            table = to_table(PERF, group)  # validates before the file name is built from these values
            folder = self.root / "perf" / self._run_dir / _segment("workload", workload) / _segment("cache", cache)
            path = folder / f"batch-{int(batch):05d}.parquet"
            write_atomic(table.select(PERF.file_schema.names), path)
            paths.append(path)
        return paths

    @property
    def run_path(self) -> Path:
        return self.root / "runs" / self._run_dir / "run.parquet"

    def write_run(self, manifest: dict[str, Any]) -> Path:
        """Write the run's manifest row; status defaults to running and started_at to now."""
        row = _with_partition(RUNS, {"status": "running", "started_at": _now(), **manifest}, {"run_id": self.run_id})
        _check_choice("runs.kind", row.get("kind"), RUN_KINDS)
        _check_choice("runs.status", row.get("status"), RUN_STATUSES)
        write_atomic(to_table(RUNS, [row]).select(RUNS.file_schema.names), self.run_path)
        return self.run_path

    def read_run(self) -> dict[str, Any] | None:
        """The manifest row as written (JSON columns still text), or None before `write_run`."""
        if not self.run_path.exists():
            return None
        return read_table(self.run_path, RUNS).to_pylist()[0]

    def update_run_status(
        self,
        status: str,
        *,
        finished_at: dt.datetime | None = None,
        skipped: dict[str, dict[str, int]] | None = None,
        placements: list[dict[str, Any]] | None = None,
        fallbacks: dict[str, str] | None = None,
        error: str | None = None,
    ) -> Path:
        """Set the status; a final one stamps finished_at (now unless given); skipped, placements and fallbacks
        replace theirs; ``error`` is kept with a failed status only (a resumed run clears it)."""
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
        return self.write_run(row)

    def write_verdicts(self, rules: str, rows: list[dict[str, Any]]) -> Path:
        """Replace the run's verdicts of one rules file (re-evaluating it supersedes them; other files' stay)."""
        fixed = {"run_id": self.run_id, "rules": rules}
        table = to_table(VERDICTS, [_with_partition(VERDICTS, row, fixed) for row in rows])
        path = self.root / "verdicts" / self._run_dir / f"rules-{re.sub(r'[^A-Za-z0-9._+-]', '_', rules)}.parquet"
        write_atomic(table.select(VERDICTS.file_schema.names), path)
        return path


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
