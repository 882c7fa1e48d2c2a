"""The Parquet sink: layout, atomic replacement, resume listing, row validation, hive reading by DuckDB; in a folder
and in the S3 server (the `root` fixture)."""

from __future__ import annotations

import threading

import duckdb
import pytest
from archive_files import hive, listing, read_parquet, write_parquet
from synthetic_archive import K2, result_row

from pipeline import archive as archive_module
from pipeline.archive import ArchiveError, ArchiveWriter
from pipeline.names import FP16


def gsm8k_rows(cache: str, ids: range, score: float = 1.0) -> list[dict]:
    return [{**result_row(cache, "gsm8k", f"g{i:02d}", score, "exact_match"), "workload_version": 3} for i in ids]


def test_shard_files_land_in_the_hive_layout_and_leave_no_temporary_files(root: str) -> None:
    path = ArchiveWriter(root, "r1").write_results("gsm8k", K2, 7, gsm8k_rows(K2, range(3)))
    relative = "results/run_id=r1/workload=gsm8k/cache=kivi-k2v2-g32-r128/shard-00007.parquet"
    assert path == f"{root}/{relative}"
    assert listing(root) == [relative]


def test_rewriting_a_shard_replaces_it_so_each_request_appears_once_per_cache(root: str) -> None:
    writer = ArchiveWriter(root, "r1")
    writer.write_results("gsm8k", FP16, 0, gsm8k_rows(FP16, range(10), score=0.0))
    writer.write_results("gsm8k", FP16, 0, gsm8k_rows(FP16, range(10), score=1.0))  # the rerun after a retry
    writer.write_results("gsm8k", K2, 0, gsm8k_rows(K2, range(10)))
    results = hive(root, "results")
    counts = duckdb.sql(
        "SELECT cache, count(*), count(DISTINCT request_id), avg(score) FROM results GROUP BY cache ORDER BY cache"
    ).fetchall()
    assert counts == [(FP16, 10, 10, 1.0), (K2, 10, 10, 1.0)]
    assert len(listing(root)) == 2  # one file per shard × cache, no temporary one


def test_a_write_that_fails_midway_keeps_the_previous_shard_and_no_temporary_file(root: str, monkeypatch) -> None:
    writer = ArchiveWriter(root, "r1")
    writer.write_results("gsm8k", FP16, 0, gsm8k_rows(FP16, range(4)))
    before = listing(root)

    def crash(table, where, **kwargs):
        where.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(archive_module.pq, "write_table", crash)
    with pytest.raises(OSError, match="disk full"):
        writer.write_results("gsm8k", FP16, 0, gsm8k_rows(FP16, range(8)))
    assert read_parquet(root, writer.shard_path("gsm8k", FP16, 0)).num_rows == 4
    assert listing(root) == before


def test_done_shards_lists_the_shards_written_for_that_workload_and_cache_only(root: str) -> None:
    writer = ArchiveWriter(root, "r1")
    for shard in (0, 2, 5):
        writer.write_results("gsm8k", FP16, shard, gsm8k_rows(FP16, range(shard, shard + 1)))
    writer.write_results("gsm8k", K2, 1, gsm8k_rows(K2, range(1)))
    write_parquet(root, f"{writer.results_dir('gsm8k', FP16)}/shard-00009.parquet.tmp-deadbeef",
                  read_parquet(root, writer.shard_path("gsm8k", FP16, 0)))  # a crashed local write
    assert writer.done_shards("gsm8k", FP16) == {0, 2, 5}
    assert writer.done_shards("gsm8k", K2) == {1}
    assert writer.has_results("gsm8k", FP16, 2) and not writer.has_results("gsm8k", FP16, 9)
    assert writer.done_shards("longbench", FP16) == set()
    assert ArchiveWriter(root, "r2").done_shards("gsm8k", FP16) == set()


def test_partition_columns_live_in_the_path_and_duckdb_reads_them_back_as_text(root: str) -> None:
    writer = ArchiveWriter(root, "20250601")
    writer.write_results("gsm8k", FP16, 0, gsm8k_rows(FP16, range(2)))
    in_file = set(read_parquet(root, writer.shard_path("gsm8k", FP16, 0)).schema.names)
    assert {"run_id", "workload", "cache"}.isdisjoint(in_file) and "request_id" in in_file
    results = hive(root, "results")
    relation = duckdb.sql("SELECT * FROM results")
    assert len(relation.columns) == len(set(relation.columns))
    partitions = duckdb.sql("SELECT DISTINCT run_id, workload, cache, shard FROM relation").fetchall()
    assert partitions == [("20250601", "gsm8k", FP16, 0)]


def test_rows_with_an_unknown_column_are_refused_naming_the_column(root: str) -> None:
    rows = [{**gsm8k_rows(FP16, range(1))[0], "scroe": 1.0}]
    with pytest.raises(ArchiveError, match="scroe"):
        ArchiveWriter(root, "r1").write_results("gsm8k", FP16, 0, rows)
    assert listing(root) == []


def test_rows_missing_a_required_value_or_with_a_lossy_type_are_refused(root: str) -> None:
    writer = ArchiveWriter(root, "r1")
    row = gsm8k_rows(FP16, range(1))[0]
    with pytest.raises(ArchiveError, match="results.request_id is required"):
        writer.write_results("gsm8k", FP16, 0, [{**row, "request_id": None}])
    with pytest.raises(ArchiveError, match="results.prompt_tokens"):
        writer.write_results("gsm8k", FP16, 0, [{**row, "prompt_tokens": 12.5}])


def test_a_row_that_contradicts_its_file_partition_is_refused(root: str) -> None:
    with pytest.raises(ArchiveError, match="results.cache='fp16' contradicts"):
        ArchiveWriter(root, "r1").write_results("gsm8k", K2, 0, [{**gsm8k_rows(K2, range(1))[0], "cache": FP16}])


@pytest.mark.parametrize("run_id", ["", "a/b", "x=1", "../up", "nightly 2025"])
def test_run_ids_that_would_break_the_folder_layout_are_refused(root: str, run_id: str) -> None:
    with pytest.raises(ArchiveError, match="run_id"):
        ArchiveWriter(root, run_id)


def test_perf_rows_are_split_per_cache_and_batch_and_a_rerun_point_replaces_its_file(root: str) -> None:
    writer = ArchiveWriter(root, "r1")
    point = {"model": "m", "workload": "sharegpt", "batch_size": 8, "tokens_per_s": 100.0, "oom": False}
    writer.write_perf([{**point, "cache": FP16}, {**point, "cache": K2}, {**point, "cache": K2, "batch_size": 16}])
    writer.write_perf([{**point, "cache": K2, "tokens_per_s": 120.0}])
    perf = hive(root, "perf")
    rows = duckdb.sql("SELECT cache, batch_size, tokens_per_s FROM perf ORDER BY cache, batch_size").fetchall()
    assert rows == [(FP16, 8, 100.0), (K2, 8, 120.0), (K2, 16, 100.0)]
    assert writer.perf_caches("sharegpt") == {FP16, K2} and writer.perf_caches("other") == set()


def test_updating_the_run_status_keeps_the_manifest_and_stamps_the_finish(root: str) -> None:
    writer = ArchiveWriter(root, "r1")
    writer.write_run({"kind": "smoke", "config_yaml": "model: x\n", "versions": {"torch": "2.13.0"}})
    assert writer.read_run()["status"] == "running" and writer.read_run()["finished_at"] is None
    writer.update_run_status("failed", skipped={"gsm8k": {"no answer": 3}})
    run = writer.read_run()
    assert (run["run_id"], run["kind"], run["status"], run["config_yaml"]) == ("r1", "smoke", "failed", "model: x\n")
    assert run["finished_at"] >= run["started_at"]
    assert run["versions"] == '{"torch": "2.13.0"}' and run["skipped"] == '{"gsm8k": {"no answer": 3}}'


def test_a_manifest_written_before_a_column_existed_reads_it_as_null_and_can_be_updated(root: str) -> None:
    writer = ArchiveWriter(root, "old")
    writer.write_run({"kind": "smoke"})
    table = read_parquet(root, writer.run_path)
    write_parquet(root, writer.run_path, table.drop_columns(["placements"]))  # as an archive of an earlier version holds it
    assert writer.read_run()["placements"] is None
    writer.update_run_status("complete", placements=[{"host": "h", "pid": 1, "jobs": 2}])
    assert writer.read_run()["placements"] == '[{"host": "h", "jobs": 2, "pid": 1}]'


def test_a_manifest_with_an_unknown_kind_or_status_is_refused(root: str) -> None:
    writer = ArchiveWriter(root, "r1")
    with pytest.raises(ArchiveError, match="runs.kind='weekly'"):
        writer.write_run({"kind": "weekly"})
    writer.write_run({"kind": "nightly"})
    with pytest.raises(ArchiveError, match="runs.status='done'"):
        writer.update_run_status("done")


def test_two_drivers_updating_one_manifest_leave_a_whole_row_of_one_of_them_at_every_moment(root: str) -> None:
    # What the archive promises when two drivers of one run id race: every read sees one driver's complete row
    # (its status with its placements), never a torn file or a mix; the later write wins.
    ArchiveWriter(root, "r1").write_run({"kind": "nightly"})

    errors = []

    def driver(status: str) -> None:
        writer = ArchiveWriter(root, "r1")
        try:
            for _ in range(15):
                writer.update_run_status(status, placements=[{"driver": status}])
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=driver, args=(status,)) for status in ("running", "complete")]
    for thread in threads:
        thread.start()
    seen = []
    while any(thread.is_alive() for thread in threads):
        seen.append(ArchiveWriter(root, "r1").read_run())
    for thread in threads:
        thread.join()
    seen.append(ArchiveWriter(root, "r1").read_run())
    assert errors == [] and len(seen) > 1
    assert all(row["placements"] in (None, f'[{{"driver": "{row["status"]}"}}]') for row in seen)
    assert seen[-1]["status"] in ("running", "complete") and seen[-1]["kind"] == "nightly"
