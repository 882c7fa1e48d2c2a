"""DuckDB views over the synthetic archive give the hand-computed scores and deltas; queries stay read-only."""

from __future__ import annotations

import pytest
from archive_files import listing, read_parquet, remove, write_parquet
from synthetic_archive import K2, K4, write_gsm8k

from pipeline.archive import RESULTS, TABLES, ArchiveWriter
from pipeline.names import FP16
from pipeline.store import ReadOnlyError, Store, format_table


@pytest.fixture(scope="module")
def store(shared_archive: str) -> Store:
    with Store(shared_archive) as s:
        yield s


def by(rows: list[dict], *keys: str, value: str) -> dict:
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r[value] for r in rows}


def test_task_scores_average_requests_and_count_an_errored_request_as_zero(store: Store) -> None:
    rows = store.records("SELECT * FROM task_scores WHERE run_id = 'nightly-a' AND workload = 'gsm8k'")
    assert by(rows, "cache", value="score") == {FP16: pytest.approx(0.70), K2: pytest.approx(0.65), K4: pytest.approx(0.70)}
    assert by(rows, "cache", value="n_errors") == {FP16: 0, K2: 1, K4: 0}
    assert by(rows, "cache", value="n") == {FP16: 20, K2: 20, K4: 20}


def test_the_longbench_score_is_the_mean_of_task_means_and_other_workloads_average_requests(store: Store) -> None:
    rows = store.records("SELECT * FROM workload_scores WHERE run_id = 'nightly-a' AND cache = 'fp16'")
    # LongBench request mean would be 0.55 (narrativeqa and trec have 4 requests, gov_report 2).
    assert by(rows, "workload", value="score") == {
        "longbench": pytest.approx(0.5), "gsm8k": pytest.approx(0.7), "niah": pytest.approx(8 / 9)}


def test_kivi_deltas_are_percentage_points_of_kivi_minus_fp16_per_workload(store: Store) -> None:
    rows = store.records("SELECT * FROM kivi_deltas WHERE run_id = 'nightly-a'")
    assert by(rows, "workload", "cache", value="delta_points") == {
        ("gsm8k", K2): pytest.approx(-5.0), ("gsm8k", K4): pytest.approx(0.0),
        ("longbench", K2): pytest.approx(-0.75), ("longbench", K4): pytest.approx(0.0),
        ("niah", K2): pytest.approx(-100 / 9), ("niah", K4): pytest.approx(0.0),
    }
    assert by(rows, "workload", "cache", value="kivi_score")[("longbench", K2)] == pytest.approx(0.4925)


def test_the_presets_table_names_each_preset_by_the_cache_the_archive_spells(store: Store) -> None:
    presets = by(store.records("SELECT * FROM presets"), "preset", value="cache")
    assert (presets["kivi-2"], presets["kivi-4"], presets["token-keys-2"]) == (K2, K4, "kivi-k2v2-g32-r128-ktoken")
    rows = store.records("SELECT DISTINCT preset, cache FROM kivi_deltas JOIN presets USING (cache) ORDER BY preset")
    assert [(r["preset"], r["cache"]) for r in rows] == [("kivi-2", K2), ("kivi-4", K4)]


def test_kivi_task_deltas_give_each_longbench_task_its_own_delta(store: Store) -> None:
    rows = store.records(
        "SELECT * FROM kivi_task_deltas WHERE run_id = 'nightly-a' AND workload = 'longbench' AND cache = $1", [K2])
    assert by(rows, "task", value="delta_points") == {
        "narrativeqa": pytest.approx(-2.25), "gov_report": pytest.approx(0.0), "trec": pytest.approx(0.0)}


def test_kivi_deltas_compare_only_requests_both_caches_answered_and_show_the_gap(root: str) -> None:
    writer = ArchiveWriter(root, "partial")
    write_gsm8k(writer, FP16, correct=10)  # shard 0 (g00..g09) all right, shard 1 all wrong
    write_gsm8k(writer, K2, correct=9, shards=(0,))  # shard 1 never written
    with Store(root) as store:
        (row,) = store.records("SELECT * FROM kivi_deltas WHERE run_id = 'partial'")
    # Shard 0 only: fp16 10/10, kivi 9/10 -> -10 points over 10 pairs, of 20 fp16 requests.
    assert (row["n_pairs"], row["n_fp16"], row["n_cache"]) == (10, 20, 10)
    assert row["delta_points"] == pytest.approx(-10.0)


def test_niah_cells_carry_context_length_and_depth_from_meta(store: Store) -> None:
    rows = store.records("SELECT * FROM niah_cells WHERE run_id = 'nightly-a' AND cache = $1 AND score < 1", [K2])
    assert sorted((r["context_length"], r["depth"]) for r in rows) == [(4096, 0.5), (4096, 1.0)]
    assert store.query("SELECT count(*) FROM niah_cells WHERE run_id = 'nightly-a'")[1] == [(27,)]


def test_throughput_gives_the_largest_batch_without_oom_and_the_ratios_to_fp16(store: Store) -> None:
    rows = {r["cache"]: r for r in store.records("SELECT * FROM throughput WHERE run_id = 'nightly-a'")}
    assert {c: (r["max_batch"], r["first_oom_batch"], r["max_tokens_per_s"]) for c, r in rows.items()} == {
        FP16: (16, 32, 320.0), K2: (64, 128, 1000.0), K4: (32, 64, 560.0)}
    assert rows[K2]["throughput_ratio"] == pytest.approx(3.125) and rows[K2]["batch_ratio"] == pytest.approx(4.0)
    assert rows[K4]["throughput_ratio"] == pytest.approx(1.75)
    assert rows[K2]["kv_compression"] == pytest.approx(16 / 3) and rows[K4]["kv_compression"] == pytest.approx(3.2)


def test_baseline_deltas_compare_the_candidate_with_the_baseline_per_workload_and_task(store: Store) -> None:
    workloads = store.records("SELECT * FROM baseline_deltas('canary-b', 'nightly-a')")
    assert by(workloads, "workload", "cache", value="delta_points")[("gsm8k", K2)] == pytest.approx(5.0)
    assert by(workloads, "workload", "cache", value="delta_points")[("longbench", K2)] == pytest.approx(0.25)
    tasks = store.records("SELECT * FROM baseline_task_deltas('canary-b', 'nightly-a') WHERE cache = $1", [K2])
    assert by(tasks, "task", value="delta_points")["gov_report"] == pytest.approx(-1.5)
    assert by(tasks, "task", value="delta_points")["narrativeqa"] == pytest.approx(2.25)


def test_a_baseline_metric_the_candidate_lacks_appears_with_no_candidate_score(archive: str) -> None:
    remove(archive, "results/run_id=canary-b/workload=niah")
    with Store(archive) as store:
        rows = store.records("SELECT * FROM baseline_deltas('canary-b', 'nightly-a') WHERE workload = 'niah'")
    assert len(rows) == 3 and all(r["candidate_score"] is None and r["baseline_score"] is not None for r in rows)


def test_views_of_an_empty_archive_are_empty_and_keep_their_columns(root: str) -> None:
    with Store(root) as store:
        for view in [*TABLES, "task_scores", "workload_scores", "kivi_deltas", "kivi_task_deltas", "niah_cells", "throughput"]:
            assert store.query(f"SELECT * FROM {view}")[1] == [], view
        _, rows = store.query("DESCRIBE results")
        assert [r[0] for r in rows] == RESULTS.schema.names
        assert dict((r[0], r[1]) for r in rows)["started_at"] == "TIMESTAMP WITH TIME ZONE"
        assert store.query("SELECT * FROM baseline_deltas('a', 'b')")[1] == []


def test_an_archive_with_results_but_no_perf_still_opens_with_an_empty_throughput_view(root: str) -> None:
    write_gsm8k(ArchiveWriter(root, "r1"), FP16, correct=3)
    with Store(root) as store:
        assert store.query("SELECT count(*) FROM results")[1] == [(20,)]
        assert store.query("SELECT * FROM throughput")[1] == []
        assert store.query("SELECT * FROM verdicts")[1] == []


def test_a_column_added_after_older_files_were_written_reads_as_null_in_them(root: str) -> None:
    writer = ArchiveWriter(root, "old-run")
    writer.write_run({"kind": "nightly", "status": "failed"})
    old = read_parquet(root, writer.run_path).drop_columns(["error"])  # a manifest written before runs.error existed
    write_parquet(root, writer.run_path, old)
    with Store(root) as store:
        assert store.records("SELECT run_id, status, error FROM runs") == [
            {"run_id": "old-run", "status": "failed", "error": None}]


@pytest.mark.parametrize("sql", [
    "INSERT INTO results SELECT * FROM results",
    "COPY (SELECT * FROM results) TO '{root}/results/leak.parquet'",
    "ATTACH '{root}/x.duckdb' AS x",
    "CREATE TABLE t AS SELECT 1",
    "DROP VIEW results",
    "SET threads = 1",
    "PRAGMA version",
    "EXPORT DATABASE '{root}/dump'",
    "EXPLAIN ANALYZE COPY (SELECT 1) TO '{root}/explained.csv'",
    "SELECT 1; DROP VIEW results",
    "SELEC 1",
])
def test_query_refuses_anything_but_one_read_only_statement(archive: str, sql: str) -> None:
    before = listing(archive)
    with Store(archive) as store:
        with pytest.raises(ReadOnlyError):
            store.query(sql.format(root=archive))
        assert store.query("SELECT count(*) FROM results WHERE run_id = 'nightly-a'")[1] == [(117,)]
    assert listing(archive) == before


@pytest.mark.parametrize("sql", [
    "SELECT count(*) FROM runs",
    "WITH r AS (SELECT * FROM runs) SELECT count(*) FROM r",
    "DESCRIBE kivi_deltas",
    "SHOW TABLES",
    "SUMMARIZE perf",
    "EXPLAIN SELECT * FROM kivi_deltas",
    "FROM runs SELECT run_id",
])
def test_query_accepts_select_with_describe_show_summarize_and_explain(store: Store, sql: str) -> None:
    columns, rows = store.query(sql)
    assert columns and rows


def test_format_table_pads_columns_and_escapes_pipes_for_markdown() -> None:
    text = format_table(["name", "value"], [("a|b", 1.23456), ("longer name", None)], floatfmt=".2f", null="–")
    assert text.splitlines() == [
        "| name        | value |",
        "| ----------- | ----- |",
        "| a\\|b        | 1.23  |",
        "| longer name | –     |",
    ]


def test_a_numeric_looking_run_id_stays_text_in_the_views(root: str) -> None:
    write_gsm8k(ArchiveWriter(root, "20250601"), FP16, correct=3)
    with Store(root) as store:
        assert store.query("SELECT DISTINCT run_id, typeof(run_id) FROM results")[1] == [("20250601", "VARCHAR")]
        assert store.query("SELECT count(*) FROM task_scores WHERE run_id = $1", ["20250601"])[1] == [(1,)]
