"""How DuckDB reads an archive in an object store: ``python -m tools.bench_store --archive s3://bucket/prefix``.

Writes ``--runs`` synthetic runs (``--shards`` shards × 3 caches of ``--rows`` requests each) under the root, then
times one query on one run three ways: the Store (pyarrow datasets handed to DuckDB, which pushes the run_id
filter into the scan: only that run's files are read), the same dataset read whole into an Arrow table first
(no pushdown: every file is read), and, for a local folder only, DuckDB's own ``read_parquet`` glob (the Store of
before, which cannot reach an object store without the httpfs extension). Medians of ``--repeat`` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import duckdb

from pipeline.archive import RESULTS, ArchiveWriter
from pipeline.names import FP16
from pipeline.archive_root import open_root
from pipeline.store import Store

CACHES = (FP16, "kivi-k2v2-g32-r128", "kivi-k4v4-g32-r128")
QUERY = "SELECT cache, count(*), avg(score) FROM results WHERE run_id = $1 GROUP BY cache"


def write_runs(root: str, runs: int, shards: int, rows: int) -> list[str]:
    run_ids = [f"bench-{i:03d}" for i in range(runs)]
    for run_id in run_ids:
        writer = ArchiveWriter(root, run_id)
        writer.write_run({"kind": "nightly", "model": "bench"})
        for cache in CACHES:
            for shard in range(shards):
                writer.write_results("gsm8k", cache, shard, [
                    dict(model="bench", workload_version=3, request_id=f"r{shard}-{i}", prediction="x" * 200,
                         score=float(i % 2), metric="exact_match") for i in range(rows)])
    return run_ids


def median_s(call, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", required=True, help="an empty root: a folder or a URI")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    began = time.perf_counter()
    run_ids = write_runs(args.archive, args.runs, args.shards, args.rows)
    out = dict(archive=args.archive, runs=args.runs, files=len(run_ids) * (1 + len(CACHES) * args.shards),
               rows_per_run=len(CACHES) * args.shards * args.rows, write_s=round(time.perf_counter() - began, 2))
    target = run_ids[len(run_ids) // 2]
    out["store_open_s"] = median_s(lambda: Store(args.archive).close(), args.repeat)
    with Store(args.archive) as store:
        expected = sorted(store.query(QUERY, [target])[1])
        out["pushdown_query_s"] = median_s(lambda: store.query(QUERY, [target]), args.repeat)
        out["explain"] = store.query("EXPLAIN " + QUERY.replace("$1", f"'{target}'"))[1][0][1]
        dataset = store.dataset(RESULTS)
    whole = duckdb.connect()

    def without_pushdown() -> list:
        whole.register("results", dataset.to_table())  # every file read before DuckDB filters
        return whole.execute(QUERY, [target]).fetchall()

    assert sorted(without_pushdown()) == expected
    out["whole_read_query_s"] = median_s(without_pushdown, args.repeat)
    root = open_root(args.archive)
    if root.is_local:
        glob = root.path(RESULTS.glob)
        native = duckdb.connect()
        native.execute(f"CREATE VIEW results AS SELECT * FROM read_parquet('{glob}', hive_partitioning = true, "
                       "hive_types = {'run_id': 'VARCHAR', 'workload': 'VARCHAR', 'cache': 'VARCHAR'})")
        assert sorted(native.execute(QUERY, [target]).fetchall()) == expected
        out["duckdb_read_parquet_query_s"] = median_s(lambda: native.execute(QUERY, [target]).fetchall(), args.repeat)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
