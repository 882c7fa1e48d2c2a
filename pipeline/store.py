"""DuckDB over the Parquet archive: one view per table, score and delta views, read-only queries.

Units: every `score` is a fraction in [0, 1] (exact match, F1, ROUGE-L, accuracy, edit similarity), and
every `delta_points` is 100 × (other − reference) in percentage points, so −2.0 means "two points worse".
An errored request (score null, error set) counts as 0: a cache that crashes on hard requests must not
look better for it. Views:

- results, perf, runs, verdicts, generations: the archive tables (empty, with their columns, before any file exists).
- run_summary: one row per run id in runs, results, perf or generations: kind, label, model, status, times, row
  counts, and gate_passed (every verdict passed; null without verdicts).
- presets: each KIVI preset of the configs (kivi-2) beside its `cache` name in the archive (kivi-k2v2-g32-r128),
  the name every table spells a cache by: `JOIN presets USING (cache) WHERE preset = 'kivi-2'`.
- task_scores: mean score per run / workload / task / cache, with n and n_errors.
- workload_scores: per run / workload / cache; LongBench averages its task means, others average requests.
- kivi_task_deltas, kivi_deltas: each non-fp16 cache vs fp16 of the same run, per task and per workload,
  over the requests both caches answered (n_pairs), with n_fp16 and n_cache so that a partial run shows.
- niah_cells: mean score per (context_length, depth) cell, from rows whose meta carries both keys.
- throughput: per run / workload / cache, the largest batch without OOM, the best tokens/s, both as
  ratios to fp16, and the KV compression fp16_kv_bytes / kv_bytes (both count the model dtype at 16 bits, so
  fp16 is 1.0 for a float32 model too).
- baseline_deltas(candidate_run, baseline_run), baseline_task_deltas(...): table macros comparing two
  runs per workload (task) and cache; a baseline metric that the candidate lacks has candidate_score null.
- kivi_pairs: every KIVI answer beside fp16's answer to the same request, with its bootstrap cluster (a
  LongBench task, a NIAH length × depth cell, else the request itself; `task_cluster` within one task).
- kivi_delta_stats, kivi_task_delta_stats, baseline_delta_stats(candidate_run, baseline_run),
  baseline_task_delta_stats(...): the same deltas with their paired statistics at 95% (pipeline.stats):
  the two scores (fp16_score and kivi_score, or baseline_score and candidate_score), n_pairs, clusters, delta_points, ci_low, ci_high, p_value, test, mde_points. Baseline pairs match by
  request id within the same workload version.
- generation_pairs: every fp16 row of a generate run beside the same input row under each other cache of the run:
  greedy (fp16 chose by argmax), exact_match (the cache gave the same token ids; false where it errored or is
  missing, null where fp16 errored), first_diff (the index of the first token where they part), the cache's KL.
- generation_agreement: per run and KIVI cache, over the rows fp16 generated greedily: greedy_rows, exact (rows
  identical), exact_match (their fraction), cache_errors, missing (rows the cache has not written: a partial
  run), mean_first_diff (over the rows that differ), mean_kl (--score-kl).
- generation_summary: per run and cache: rows, error_rows, output tokens (total, mean), finish reasons (eos,
  stop, length) and tokens_per_s, output tokens over the actors' seconds on its shards (actor_s).
- paired_delta_stats(reference_scores, candidate_scores, clusters, mean_of_clusters, confidence): the scalar
  function behind those views, for any pairing a query builds (lists from `list(...)` in a GROUP BY).
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Sequence
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
from duckdb.sqltypes import BIGINT, BOOLEAN, DOUBLE, VARCHAR

from kivi.config import did_you_mean, preset_caches
from pipeline.archive import TABLES, TableSpec
from pipeline.archive_root import ArchiveRoot, open_root
from pipeline.errors import InputError
from pipeline.names import FP16
from pipeline.stats import TASK_AVERAGED_WORKLOADS, VIEW_CONFIDENCE, paired_delta, ratio_interval


_AVERAGED = ", ".join(f"'{w}'" for w in TASK_AVERAGED_WORKLOADS)


# Bootstrap clusters: requests that share a LongBench task or a NIAH cell are not independent draws.
def _task_cluster(t: str) -> str:
    """The cluster of a row of results ``t`` within its task: its NIAH cell, else the request itself."""
    return f"coalesce(({t}.meta ->> '$.context_length') || '/' || ({t}.meta ->> '$.depth'), {t}.task || '/' || {t}.request_id)"


def _cluster(t: str) -> str:
    """The cluster of a row of results ``t`` within its workload: a LongBench task, else as within the task."""
    return f"CASE WHEN {t}.workload IN ({_AVERAGED}) THEN {t}.task ELSE {_task_cluster(t)} END"


def _delta_stats(pairs: str, keys: str, reference: str, candidate: str, task_level: bool) -> str:
    """The paired statistics of ``pairs`` (a view or macro call) grouped by ``keys``: per workload, or per task."""
    cluster, averaged = ("task_cluster", "false") if task_level else ("cluster", f"workload IN ({_AVERAGED})")
    return f"""
        SELECT {keys}, s.reference_score AS {reference}, s.candidate_score AS {candidate}, s.n_pairs, s.clusters, s.delta_points, s.ci_low, s.ci_high, s.p_value, s.test, s.mde_points
        FROM (SELECT {keys}, paired_delta_stats(list({reference}), list({candidate}), list({cluster}), {averaged},
                                                {VIEW_CONFIDENCE}) AS s
              FROM {pairs} GROUP BY {keys})"""


_RUN_KEYS = "run_id, model, workload, workload_version"
_BASELINE_KEYS = "candidate_run_id, baseline_run_id, workload, workload_version"

_VIEWS = {
    "run_summary": """
        WITH r AS (SELECT run_id, any_value(model) AS model, count(*) AS results, count(error) AS errors
                   FROM results GROUP BY run_id),
             p AS (SELECT run_id, any_value(model) AS model, count(*) AS perf_points FROM perf GROUP BY run_id),
             v AS (SELECT run_id, count(*) AS verdicts, bool_and(passed) AS gate_passed FROM verdicts GROUP BY run_id),
             g AS (SELECT run_id, any_value(model) AS model, count(*) AS generations, count(error_code) AS error_rows
                   FROM generations GROUP BY run_id)
        SELECT run_id, m.kind, coalesce(m.label, m.kind) AS label, coalesce(m.model, r.model, p.model, g.model) AS model,
               m.status, m.started_at, m.finished_at, coalesce(r.results, 0) AS results, coalesce(r.errors, 0) AS errors,
               coalesce(p.perf_points, 0) AS perf_points, coalesce(v.verdicts, 0) AS verdicts, v.gate_passed,
               coalesce(g.generations, 0) AS generations, coalesce(g.error_rows, 0) AS generation_errors
        FROM (SELECT run_id FROM runs UNION SELECT run_id FROM results UNION SELECT run_id FROM perf
              UNION SELECT run_id FROM generations)
             LEFT JOIN runs m USING (run_id) LEFT JOIN r USING (run_id) LEFT JOIN p USING (run_id)
             LEFT JOIN v USING (run_id) LEFT JOIN g USING (run_id)""",
    "task_scores": """
        SELECT run_id, model, workload, workload_version, task, cache, any_value(metric) AS metric,
               avg(coalesce(score, 0)) AS score, count(*) AS n, count(error) AS n_errors
        FROM results GROUP BY ALL""",
    "workload_scores": f"""
        SELECT run_id, model, workload, workload_version, cache,
               CASE WHEN workload IN ({_AVERAGED}) THEN avg(score) ELSE sum(score * n) / sum(n) END AS score,
               sum(n) AS n, sum(n_errors) AS n_errors, count(*) AS n_tasks
        FROM task_scores GROUP BY run_id, model, workload, workload_version, cache""",
    # Each KIVI answer is paired with the fp16 answer to the same request, so both means cover the same inputs.
    "kivi_task_deltas": f"""
        SELECT d.*, 100 * (d.kivi_score - d.fp16_score) AS delta_points, f.n AS n_fp16, k.n AS n_cache
        FROM (
            SELECT k.run_id, k.model, k.workload, k.workload_version, k.task, k.cache,
                   avg(coalesce(f.score, 0)) AS fp16_score, avg(coalesce(k.score, 0)) AS kivi_score,
                   count(*) AS n_pairs
            FROM results k JOIN results f
              ON f.run_id = k.run_id AND f.workload = k.workload AND f.task = k.task AND f.request_id = k.request_id
            WHERE f.cache = '{FP16}' AND k.cache <> '{FP16}'
            GROUP BY ALL) d
        JOIN task_scores f ON f.run_id = d.run_id AND f.workload = d.workload AND f.task = d.task AND f.cache = '{FP16}'
        JOIN task_scores k ON k.run_id = d.run_id AND k.workload = d.workload AND k.task = d.task AND k.cache = d.cache""",
    "kivi_deltas": f"""
        SELECT d.*, 100 * (d.kivi_score - d.fp16_score) AS delta_points, f.n AS n_fp16, k.n AS n_cache
        FROM (
            SELECT run_id, model, workload, workload_version, cache,
                   CASE WHEN workload IN ({_AVERAGED}) THEN avg(fp16_score)
                        ELSE sum(fp16_score * n_pairs) / sum(n_pairs) END AS fp16_score,
                   CASE WHEN workload IN ({_AVERAGED}) THEN avg(kivi_score)
                        ELSE sum(kivi_score * n_pairs) / sum(n_pairs) END AS kivi_score,
                   sum(n_pairs) AS n_pairs, count(*) AS n_tasks
            FROM kivi_task_deltas GROUP BY run_id, model, workload, workload_version, cache) d
        JOIN workload_scores f ON f.run_id = d.run_id AND f.workload = d.workload AND f.cache = '{FP16}'
        JOIN workload_scores k ON k.run_id = d.run_id AND k.workload = d.workload AND k.cache = d.cache""",
    "kivi_pairs": f"""
        SELECT k.run_id, k.model, k.workload, k.workload_version, k.task, k.cache, k.request_id,
               coalesce(f.score, 0) AS fp16_score, coalesce(k.score, 0) AS kivi_score,
               {_cluster("k")} AS cluster, {_task_cluster("k")} AS task_cluster
        FROM results k JOIN results f
          ON f.run_id = k.run_id AND f.workload = k.workload AND f.task = k.task AND f.request_id = k.request_id
        WHERE f.cache = '{FP16}' AND k.cache <> '{FP16}'""",
    "kivi_delta_stats": _delta_stats("kivi_pairs", f"{_RUN_KEYS}, cache", "fp16_score", "kivi_score", False),
    "kivi_task_delta_stats": _delta_stats("kivi_pairs", f"{_RUN_KEYS}, task, cache", "fp16_score", "kivi_score", True),
    "niah_cells": """
        SELECT run_id, model, workload, task, cache,
               CAST(meta ->> '$.context_length' AS BIGINT) AS context_length,
               CAST(meta ->> '$.depth' AS DOUBLE) AS depth,
               avg(coalesce(score, 0)) AS score, count(*) AS n
        FROM results
        WHERE meta ->> '$.context_length' IS NOT NULL AND meta ->> '$.depth' IS NOT NULL
        GROUP BY ALL""",
    # A sweep point may be timed several times (sweep.repeats): its tokens/s is their mean, the best batch is
    # the one with the highest mean, and the ratio's interval resamples both sides' timings at that batch.
    "throughput": f"""
        WITH b AS (
            SELECT run_id, model, workload, cache, batch_size, any_value(device) AS device, bool_or(oom) AS oom,
                   avg(tokens_per_s) AS tokens_per_s, list(tokens_per_s) AS timings,
                   max(peak_mem_bytes) AS peak_mem_bytes, sum(fp16_kv_bytes) AS fp16_kv_bytes, sum(kv_bytes) AS kv_bytes
            FROM perf GROUP BY run_id, model, workload, cache, batch_size),
        c AS (
            SELECT run_id, model, workload, cache, any_value(device) AS device,
                   max(batch_size) FILTER (WHERE NOT oom) AS max_batch,
                   min(batch_size) FILTER (WHERE oom) AS first_oom_batch,
                   max(tokens_per_s) FILTER (WHERE NOT oom) AS max_tokens_per_s,
                   arg_max(timings, tokens_per_s) FILTER (WHERE NOT oom) AS best_timings,
                   max(peak_mem_bytes) FILTER (WHERE NOT oom) AS max_peak_mem_bytes,
                   sum(fp16_kv_bytes) FILTER (WHERE NOT oom) / sum(kv_bytes) FILTER (WHERE NOT oom) AS kv_compression
            FROM b GROUP BY run_id, model, workload, cache)
        SELECT * EXCLUDE (r), r.ci_low AS ratio_ci_low, r.ci_high AS ratio_ci_high, r.repeats
        FROM (SELECT c.* EXCLUDE (best_timings), c.max_tokens_per_s / f.max_tokens_per_s AS throughput_ratio,
                     c.max_batch / f.max_batch AS batch_ratio,
                     ratio_interval_stats(f.best_timings, c.best_timings, {VIEW_CONFIDENCE}) AS r
              FROM c LEFT JOIN c AS f ON f.run_id = c.run_id AND f.workload = c.workload AND f.cache = '{FP16}')""",
    # Driven from fp16's rows, so that a row the cache lost or failed counts against it.
    "generation_pairs": f"""
        SELECT f.run_id, f.model, c.cache, f.row, f.id, f.temperature = 0 AS greedy, f.error_code AS fp16_error,
               k.error_code AS cache_error, k.row IS NULL AS missing,
               CASE WHEN f.error_code IS NULL THEN coalesce(k.output_token_ids = f.output_token_ids, false) END
                   AS exact_match,
               CASE WHEN k.output_token_ids <> f.output_token_ids THEN list_position(list_transform(
                   list_zip(f.output_token_ids, k.output_token_ids), lambda t: t[1] IS DISTINCT FROM t[2]), true) - 1
               END AS first_diff,
               f.output_tokens AS fp16_output_tokens, k.output_tokens, k.kl_to_fp16
        FROM generations f
        JOIN (SELECT DISTINCT run_id, cache FROM generations WHERE cache <> '{FP16}') c USING (run_id)
        LEFT JOIN generations k ON k.run_id = f.run_id AND k.cache = c.cache AND k.row = f.row
        WHERE f.cache = '{FP16}'""",
    "generation_agreement": """
        SELECT run_id, any_value(model) AS model, cache,
               count(*) FILTER (WHERE greedy AND fp16_error IS NULL) AS greedy_rows,
               count(*) FILTER (WHERE greedy AND exact_match) AS exact,
               avg(exact_match::INT) FILTER (WHERE greedy) AS exact_match,
               count(*) FILTER (WHERE cache_error IS NOT NULL AND fp16_error IS NULL) AS cache_errors,
               count(*) FILTER (WHERE missing) AS missing,
               avg(first_diff) FILTER (WHERE greedy) AS mean_first_diff, avg(kl_to_fp16) AS mean_kl
        FROM generation_pairs GROUP BY run_id, cache""",
    "generation_summary": """
        WITH shards AS (SELECT run_id, cache, shard, any_value(shard_s) AS shard_s FROM generations GROUP BY ALL),
             actors AS (SELECT run_id, cache, sum(shard_s) AS actor_s FROM shards GROUP BY ALL)
        SELECT run_id, any_value(g.model) AS model, cache, count(*) AS rows, count(g.error_code) AS error_rows,
               sum(g.output_tokens) AS output_tokens, avg(g.output_tokens) AS mean_output_tokens,
               count(*) FILTER (WHERE g.finish_reason = 'eos') AS eos,
               count(*) FILTER (WHERE g.finish_reason = 'stop') AS stop,
               count(*) FILTER (WHERE g.finish_reason = 'length') AS length,
               sum(g.output_tokens) / any_value(a.actor_s) AS tokens_per_s, any_value(a.actor_s) AS actor_s
        FROM generations g JOIN actors a USING (run_id, cache) GROUP BY run_id, cache""",
}

# Driven from the baseline side so that a metric the candidate lost shows up (candidate_score null).
_MACROS = [
    """CREATE MACRO baseline_deltas(candidate_run, baseline_run) AS TABLE
        SELECT candidate_run AS candidate_run_id, baseline_run AS baseline_run_id, b.workload, b.cache,
               c.workload_version AS candidate_version, b.workload_version AS baseline_version,
               b.score AS baseline_score, c.score AS candidate_score,
               100 * (c.score - b.score) AS delta_points, b.n AS baseline_n, c.n AS candidate_n
        FROM workload_scores b LEFT JOIN workload_scores c
          ON c.run_id = candidate_run AND c.workload = b.workload AND c.cache = b.cache
        WHERE b.run_id = baseline_run""",
    """CREATE MACRO baseline_task_deltas(candidate_run, baseline_run) AS TABLE
        SELECT candidate_run AS candidate_run_id, baseline_run AS baseline_run_id, b.workload, b.task, b.cache,
               c.workload_version AS candidate_version, b.workload_version AS baseline_version,
               b.score AS baseline_score, c.score AS candidate_score,
               100 * (c.score - b.score) AS delta_points, b.n AS baseline_n, c.n AS candidate_n
        FROM task_scores b LEFT JOIN task_scores c
          ON c.run_id = candidate_run AND c.workload = b.workload AND c.task = b.task AND c.cache = b.cache
        WHERE b.run_id = baseline_run""",
    f"""CREATE MACRO baseline_pairs(candidate_run, baseline_run) AS TABLE
        SELECT candidate_run AS candidate_run_id, baseline_run AS baseline_run_id, b.workload, b.workload_version,
               b.task, b.cache, b.request_id, coalesce(b.score, 0) AS baseline_score,
               coalesce(c.score, 0) AS candidate_score,
               {_cluster("b")} AS cluster, {_task_cluster("b")} AS task_cluster
        FROM results b JOIN results c
          ON c.run_id = candidate_run AND c.workload = b.workload AND c.workload_version = b.workload_version
             AND c.task = b.task AND c.request_id = b.request_id AND c.cache = b.cache
        WHERE b.run_id = baseline_run""",
    "CREATE MACRO baseline_delta_stats(candidate_run, baseline_run) AS TABLE" + _delta_stats(
        "baseline_pairs(candidate_run, baseline_run)", f"{_BASELINE_KEYS}, cache", "baseline_score", "candidate_score",
        False),
    "CREATE MACRO baseline_task_delta_stats(candidate_run, baseline_run) AS TABLE" + _delta_stats(
        "baseline_pairs(candidate_run, baseline_run)", f"{_BASELINE_KEYS}, task, cache", "baseline_score",
        "candidate_score", True),
]


# What a query may name, for the message of one that names something else.
KNOWN = ", ".join([*TABLES, "presets", *_VIEWS, *(re.search(r"MACRO (\w+\(.*?\))", m)[1] for m in _MACROS)])
NEWEST_FIRST = "ORDER BY started_at DESC NULLS LAST, run_id DESC"  # runs without a manifest row last


class QueryError(InputError):
    """A statement DuckDB cannot run over the archive (a typo in a name, a syntax error)."""


class ReadOnlyError(QueryError):
    """A statement that could change state was refused."""


class UnknownRunError(InputError):
    """The archive holds no run of that id; the message names the closest ones."""


class Store:
    """An in-memory DuckDB whose views read the archive under ``root`` (a folder or a URI); it never writes there.

    Each table is a pyarrow dataset over the files that exist when the store opens, handed to DuckDB, which pushes
    its column and filter choices into the scan: a query on one run lists the archive once and opens only that
    run's files, in a folder or an object store alike (BENCHMARKS.md, "DuckDB over an object store")."""

    def __init__(self, root: str | os.PathLike[str] | ArchiveRoot) -> None:
        self.root = open_root(root)
        self._con = duckdb.connect(":memory:")
        self._con.create_function("paired_delta_stats", _paired_delta_stats,
                                  [duckdb.list_type(DOUBLE), duckdb.list_type(DOUBLE), duckdb.list_type(VARCHAR), BOOLEAN,
                                   DOUBLE], _PAIRED_DELTA_STATS, side_effects=False)
        self._con.create_function("ratio_interval_stats", _ratio_interval_stats,
                                  [duckdb.list_type(DOUBLE), duckdb.list_type(DOUBLE), DOUBLE], _RATIO_INTERVAL_STATS,
                                  null_handling="special", side_effects=False)
        for spec in TABLES.values():
            self._con.register(f"_files_{spec.name}", self.dataset(spec))
            self._con.execute(f"CREATE VIEW {spec.name} AS SELECT {', '.join(spec.schema.names)} FROM _files_{spec.name}")
        self._con.execute("CREATE TABLE presets (preset VARCHAR, cache VARCHAR)")
        self._con.executemany("INSERT INTO presets VALUES (?, ?)", list(preset_caches().items()))
        for name, sql in _VIEWS.items():
            self._con.execute(f"CREATE VIEW {name} AS {sql}")
        for sql in _MACROS:
            self._con.execute(sql)

    def dataset(self, spec: TableSpec) -> ds.Dataset:
        """The files of one table, as its view reads them."""
        # The table's schema, given whole: no files still gives its columns and types, a column added after older
        # files were written reads as null in them, and hive values stay text (run_id=20240601 is not a number).
        folder = spec.glob.split("/", 1)[0]
        partitioning = ds.partitioning(pa.schema([(p, pa.string()) for p in spec.partitions]), flavor="hive")
        return ds.dataset([self.root.path(f) for f in self.root.glob(spec.glob)], schema=spec.schema, format="parquet",
                          filesystem=self.root.fs, partitioning=partitioning, partition_base_dir=self.root.path(folder))

    def query(self, sql: str, params: Sequence[Any] = ()) -> tuple[list[str], list[tuple]]:
        """Run one read-only statement (SELECT, WITH, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN); columns and rows."""
        self._check_read_only(sql)
        try:
            cursor = self._con.execute(sql, list(params))
        except duckdb.Error as e:
            raise QueryError(f"{_one_line(e)} (tables, views and macros: {KNOWN})") from e
        return [d[0] for d in cursor.description], cursor.fetchall()

    def records(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """`query` as one dict per row."""
        columns, rows = self.query(sql, params)
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def _check_read_only(self, sql: str) -> None:
        try:
            statements = self._con.extract_statements(sql)
        except duckdb.Error as e:
            raise ReadOnlyError(f"cannot parse query: {_one_line(e)}") from e
        if len(statements) != 1:
            raise ReadOnlyError(f"expected one statement, got {len(statements)}")
        statement = statements[0]
        if statement.type == duckdb.StatementType.EXPLAIN:
            # EXPLAIN ANALYZE executes its statement (EXPLAIN ANALYZE COPY … writes a file): check what it wraps.
            inner = re.sub(r"^\s*explain\s+(analyze\s+)?", "", statement.query, flags=re.IGNORECASE)
            statement = self._con.extract_statements(inner)[0]
        if statement.type != duckdb.StatementType.SELECT:
            raise ReadOnlyError(
                f"only SELECT, WITH, DESCRIBE, SHOW, SUMMARIZE and EXPLAIN are allowed; got {statement.type.name}"
            )

    def run_ids(self) -> list[str]:
        """Every run the archive holds (a manifest row, results or perf points), newest first."""
        return [run_id for (run_id,) in self.query(f"SELECT run_id FROM run_summary {NEWEST_FIRST}")[1]]

    def require_run(self, run_id: str) -> None:
        """Raise UnknownRunError naming the closest and the newest runs unless the archive holds ``run_id``."""
        known = self.run_ids()
        if run_id not in known:
            newest = ", ".join(known[:5]) + (", …" if len(known) > 5 else "")
            raise UnknownRunError(f"no run {run_id!r} in the archive {self.root}{did_you_mean(run_id, known, n=3)}; "
                                  f"newest runs: {newest or 'none'}")

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PAIRED_DELTA_STATS = duckdb.struct_type(dict(
    reference_score=DOUBLE, candidate_score=DOUBLE, n_pairs=BIGINT, clusters=BIGINT, delta_points=DOUBLE, ci_low=DOUBLE, ci_high=DOUBLE, p_value=DOUBLE, test=VARCHAR,
    mde_points=DOUBLE))


def _paired_delta_stats(reference: list[float], candidate: list[float], clusters: list[str], mean_of_clusters: bool,
                        confidence: float) -> dict[str, Any]:
    d = paired_delta(reference, candidate, clusters, mean_of_clusters, confidence)
    return dict(reference_score=d.reference_score, candidate_score=d.candidate_score, n_pairs=d.n, clusters=d.clusters, delta_points=d.delta, ci_low=d.ci_low, ci_high=d.ci_high,
                p_value=d.p_value, test=d.test, mde_points=d.mde)


_RATIO_INTERVAL_STATS = duckdb.struct_type(dict(ratio=DOUBLE, ci_low=DOUBLE, ci_high=DOUBLE, repeats=BIGINT))


def _ratio_interval_stats(reference: list[float] | None, candidate: list[float] | None,
                          confidence: float) -> dict[str, Any] | None:
    if not reference or not candidate:  # a side without a sweep point: the ratio is missing, not an error
        return None
    r = ratio_interval(reference, candidate, confidence)
    return dict(ratio=r.ratio, ci_low=r.ci_low, ci_high=r.ci_high, repeats=r.repeats)


def preset_hint(sql: str) -> str | None:
    """What to say of a query that found nothing while naming a preset in a string (``WHERE cache = 'kivi-2'``): the
    archive spells a cache by its configuration, so such a filter matches nothing without any error."""
    named = {preset: cache for preset, cache in preset_caches().items() if f"'{preset}'" in sql}
    if not named:
        return None
    names = ", ".join(f"'{preset}' is '{cache}'" for preset, cache in named.items())
    preset = next(iter(named))
    return (f"no rows, and the query names the preset{'s' * (len(named) > 1)} {', '.join(map(repr, named))}: the cache "
            f"column holds archive names ({names}); filter on those, or on the preset through the presets table: "
            f"… JOIN presets USING (cache) WHERE preset = '{preset}'")


def _one_line(err: duckdb.Error) -> str:
    """DuckDB's message without the quoted statement and its caret line, on one line."""
    return " ".join(str(err).split("\n\nLINE ")[0].split())


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], floatfmt: str = ".4f", null: str = "NULL") -> str:
    """A pipe table (GitHub markdown) with padded columns, readable in a terminal too."""

    def cell(value: Any) -> str:
        if value is None:
            return null
        if isinstance(value, float):
            text = format(value, floatfmt)
        elif isinstance(value, dt.datetime):  # run times to the second: the microseconds are noise in a table
            text = value.isoformat(sep=" ", timespec="seconds")
        else:
            text = str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    body = [[cell(v) for v in row] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in body)]) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in body)])
