"""The markdown report: sections with the hand-computed numbers, PNGs that decode, sections left out without data,
the deltas' 95% intervals in the tables and as error bars, and the history of the gated metrics over earlier runs."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from archive_files import copy
from matplotlib.collections import LineCollection
from synthetic_archive import K2, K4, write_gsm8k
from test_archive_history import GSM8K_K2_RULE, add_run, gate_with

from pipeline import report as report_module
from pipeline.archive import ArchiveWriter
from pipeline.gate import evaluate, load_gate, write_verdicts
from pipeline.names import FP16
from pipeline.report import write_report
from pipeline.store import Store

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(shared_archive: str, new_root, tmp_path_factory: pytest.TempPathFactory) -> Path:
    archive = new_root("with-verdicts")
    copy(shared_archive, archive)
    with Store(archive) as store:
        for name in ("nightly", "smoke"):
            rules = REPO / f"configs/gates/{name}.yaml"
            write_verdicts(archive, "nightly-a", evaluate(store, "nightly-a", load_gate(rules)), rules)
    with Store(archive) as store:
        return write_report(store, "nightly-a", tmp_path_factory.mktemp("reports") / "nightly-a")


def test_the_report_and_its_pngs_are_written_and_the_pngs_decode(report: Path) -> None:
    assert report.name == "report.md"
    pngs = sorted(p.name for p in report.parent.glob("*.png"))
    assert pngs == ["deltas.png", "niah-niah-niah.png", "throughput.png"]
    for name in pngs:
        image = matplotlib.image.imread(report.parent / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0.01, f"{name} is blank"
        assert f"]({name})" in report.read_text()


def test_the_score_table_shows_fp16_kivi_and_the_delta_in_points_with_its_interval_and_p(report: Path) -> None:
    text = report.read_text()
    # One discordant pair in 20: the resampled count is Binomial(20, 1/20), whose 2.5% and 97.5% points are 0
    # and 3 (-15 points); exact McNemar on one discordant pair is 1.
    assert f"| gsm8k     | {K2} | 70.00 | 65.00 | -5.00    | [-15.00, +0.00] | 1   | mcnemar" in text
    assert f"| longbench | {K2} | 50.00 | 49.25 | -0.75    | [-2.25, +0.00]  |" in text


def test_longbench_gets_a_per_task_table_with_each_task_delta(report: Path) -> None:
    text = report.read_text()
    section = text.split("### longbench per task", 1)[1].split("\n\n", 2)[1]
    assert f"| narrativeqa | qa_f1          | {K2} | 50.00 | 47.75 | -2.25    | [-6.75, +0.00] |" in section
    assert "### gsm8k per task" not in text  # one task: the workload row says it all


def figures_of(archive: str, run_id: str, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The report's figures by PNG name, kept instead of saved."""
    figures = {}
    monkeypatch.setattr(report_module, "_save", lambda fig, path: figures.setdefault(path.name, fig))
    with Store(archive) as store:
        write_report(store, run_id, out)
    return figures


def whiskers(ax, axis: int) -> list[tuple[float, float]]:
    """The (low, high) ends of every error bar drawn on ``ax`` along ``axis`` (0: x, 1: y)."""
    return [(min(s[:, axis]), max(s[:, axis])) for c in ax.collections if isinstance(c, LineCollection)
            for s in c.get_segments()]


def test_the_delta_figure_draws_each_delta_with_its_95_interval(shared_archive, tmp_path, monkeypatch) -> None:
    (ax,) = figures_of(shared_archive, "nightly-a", tmp_path, monkeypatch)["deltas.png"].axes
    with Store(shared_archive) as store:
        tasks = store.records("SELECT * FROM kivi_task_delta_stats WHERE run_id = 'nightly-a'")
        workloads = store.records("SELECT * FROM kivi_delta_stats WHERE run_id = 'nightly-a' AND workload = 'longbench'")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["gsm8k", "longbench (all tasks)", "longbench/gov_report", "longbench/narrativeqa", "longbench/trec",
                      "niah"]
    drawn = [(round(low, 6), round(high, 6)) for low, high in whiskers(ax, 0)]
    assert len(drawn) == len(labels) * 2  # one per label and cache
    assert sorted(drawn) == sorted((round(r["ci_low"], 6), round(r["ci_high"], 6)) for r in tasks + workloads)
    assert (-15.0, 0.0) in drawn and (-6.75, 0.0) in drawn  # gsm8k and narrativeqa, kivi-2


def test_each_niah_heatmap_cell_carries_its_score_as_text(shared_archive: str, tmp_path: Path, monkeypatch) -> None:
    figures = figures_of(shared_archive, "nightly-a", tmp_path, monkeypatch)
    panels = {ax.get_title(): ax for ax in figures["niah-niah-niah.png"].axes if ax.get_title()}
    assert sorted(panels) == sorted([FP16, K2, K4])
    for cache, lost in ((FP16, {(2, 2)}), (K2, {(2, 1), (2, 2)}), (K4, {(2, 2)})):  # (length index, depth index)
        texts = {tuple(t.get_position()): t.get_text() for t in panels[cache].texts}
        assert len(texts) == 9
        assert {cell for cell, text in texts.items() if text == "0.00"} == lost
        assert {text for cell, text in texts.items() if cell not in lost} == {"1.00"}


def test_the_throughput_table_gives_max_batch_and_the_ratio_to_fp16(report: Path) -> None:
    text = report.read_text()
    assert f"| sharegpt | {K2} | 64        | 128             | 1000.00      | 3.12" in text


def test_the_kv_size_is_a_fraction_of_fp16s_as_in_the_readme_and_explained_below_the_table(report: Path) -> None:
    section = report.read_text().split("## Throughput sweep\n\n", 1)[1].split("\n## ", 1)[0]
    assert "| KV bytes / fp16 |" in section and f"| {K2} |" in section and "| 0.19            | H200   |" in section
    assert "KV bytes / fp16: the sweep's cache" in section and "up to 640 tokens per sequence here" in section
    assert "Measured on a CPU" not in section  # an H200's sweep
    assert "![Tokens/s and peak memory vs batch size; × marks OOM](throughput.png)" in section  # GPU: memory drawn


def test_a_cpu_sweep_is_flagged_and_its_caption_promises_no_memory_panel(root: str, tmp_path: Path) -> None:
    writer = ArchiveWriter(root, "cpu")
    for cache, tokens_per_s in ((FP16, 30.0), (K2, 27.0)):
        writer.write_perf([{"model": "m", "cache": cache, "workload": "sharegpt", "batch_size": 1, "prompt_len": 100,
                            "gen_len": 32, "tokens_per_s": tokens_per_s, "kv_bytes": 40, "fp16_kv_bytes": 100,
                            "oom": False, "device": "cpu"}])
    write_gsm8k(writer, FP16, correct=10)
    write_gsm8k(writer, K2, correct=10)
    with Store(root) as store:
        text = write_report(store, "cpu", tmp_path / "out").read_text()
    section = text.split("## Throughput sweep\n\n", 1)[1].split("\n## ", 1)[0]
    assert "**Measured on a CPU**: there KIVI runs on the PyTorch reference path" in section
    assert "![Tokens/s vs batch size (peak memory is measured on GPUs only); × marks OOM](throughput.png)" in section
    summary = text.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0]
    assert f"Throughput (**kivi-2** (`{K2}`) 0.90× fp16's tokens/s) was measured on a CPU: there KIVI runs" in summary


def test_the_report_opens_with_a_summary_of_each_cache_the_gates_and_the_smallest_loss_n_can_see(report: Path) -> None:
    text = report.read_text()
    assert text.index("## Summary") < text.index("## Scores")
    summary = text.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0]
    assert summary.startswith(
        f"**kivi-2** (`{K2}`) drops 5.00 points on gsm8k, not significantly at n = 20 [-15.00, +0.00] and 11.11 points on "
        "niah, not significantly at n = 9 [-33.33, +0.00]; it matches fp16 (within a point, inside its 95% interval) on "
        f"longbench. **kivi-4** (`{K4}`) matches fp16 (within a point, inside its 95% interval) on gsm8k, longbench and "
        "niah. ")
    assert (f"Gate nightly failed 3 of 9 verdicts (kl-kivi2 on {K2}, kl-kivi4 on {K4} and niah-cells on {K2}). "
            f"Gate smoke failed 2 of 5 verdicts") in summary
    # niah: 1 lost cell of 9 for kivi-2, so its bootstrap spreads widest.
    assert f"the smallest loss found with 80% power is up to 29.2 points (niah on {K2})" in summary
    assert f"Throughput: **kivi-2** (`{K2}`) 3.12× and **kivi-4** (`{K4}`) 1.75× fp16's best tokens/s" in summary


def test_a_cache_that_loses_beyond_its_interval_is_named_with_the_loss(root: str, tmp_path: Path) -> None:
    writer = ArchiveWriter(root, "lossy")
    write_gsm8k(writer, FP16, correct=20)
    write_gsm8k(writer, K2, correct=10)
    with Store(root) as store:
        text = write_report(store, "lossy", tmp_path / "out").read_text()
    summary = text.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0]
    assert summary.startswith(f"**kivi-2** (`{K2}`) loses 50.00 points on gsm8k [-") and "The run was not gated." in summary


def test_the_header_verdicts_skipped_counts_and_config_are_reported(report: Path) -> None:
    text = report.read_text()
    assert "# KIVI evaluation: `nightly-a`" in text and "| transformers | 5.17.0" in text and "| status       | complete" in text
    assert "**FAIL**" in text
    assert "| longbench | empty context     | 1" not in text and "| longbench | empty context     | 2" in text
    assert "```yaml\nmodel: {spec: smollm2-135m}" in text
    assert "| actor 0      | node1 pid 7 cuda GPU 1 (22c5e003…): 9 jobs, ready after 21.4 s (constructor 9.8 s)" in text


def test_the_gate_section_shows_each_rules_file_under_its_own_heading(report: Path) -> None:
    text = report.read_text()
    nightly, smoke = (f"## Gate {name} (`{REPO / 'configs/gates' / name}.yaml`)" for name in ("nightly", "smoke"))
    assert f"{nightly}: 6 of 9 verdicts passed" in text and f"{smoke}: 3 of 5 verdicts passed" in text
    nightly_section = text.split(nightly, 1)[1].split("\n## ", 1)[0]
    assert "| niah-cells" in nightly_section and "| fidelity-kivi4" not in nightly_section


def test_a_run_with_only_gsm8k_gets_a_report_without_the_missing_sections(root: str, tmp_path: Path) -> None:
    writer = ArchiveWriter(root, "small")
    write_gsm8k(writer, FP16, correct=10)
    write_gsm8k(writer, K2, correct=8)
    with Store(root) as store:
        path = write_report(store, "small", tmp_path / "out")
    text = path.read_text()
    assert f"| gsm8k    | {K2} | 50.00 | 40.00 | -10.00" in text and "no manifest row" in text
    assert "Throughput" not in text and "Needle" not in text and "Gate" not in text
    assert sorted(p.name for p in path.parent.glob("*.png")) == ["deltas.png"]


@pytest.fixture
def nightlies(archive: Path, tmp_path: Path) -> Path:
    """The synthetic archive, three later nightly runs (gsm8k only, kivi-2 -5, 0 and -10 points) and a canary
    among them; nightly-3 gated on gsm8k / kivi-2 alone."""
    for day, k2_correct in ((1, 13), (2, 14), (3, 12)):
        add_run(archive, f"nightly-{day}", day, k2_correct)
    add_run(archive, "canary-2", 2, 4, kind="canary")
    gate_with(archive, "nightly-3", tmp_path / "gsm8k.yaml", GSM8K_K2_RULE)
    return archive


def test_the_history_plots_each_gated_metric_over_earlier_runs_of_the_same_kind(nightlies, tmp_path, monkeypatch) -> None:
    with Store(nightlies) as store:
        text = write_report(store, "nightly-3", tmp_path / "report").read_text()
    section = text.split("## History: smollm2-135m, nightly runs\n\n", 1)[1].split("\n## ", 1)[0]
    assert section.startswith("Each gated metric of this run, beside the archive's 3 earlier runs.")
    assert f"| gsm8k    | {K2} | 4    | -10.00     |" in section and K4 not in section  # the canaries are another kind
    assert "](history.png)" in section and (tmp_path / "report/history.png").is_file()
    (ax,) = figures_of(nightlies, "nightly-3", tmp_path / "figures", monkeypatch)["history.png"].axes
    points, = [c for c in ax.collections if not isinstance(c, LineCollection)]
    assert points.get_offsets().tolist() == [[0, -5], [1, -5], [2, 0], [3, -10]]  # nightly-a, -1, -2, -3
    with Store(nightlies) as store:
        intervals = store.records("SELECT ci_low, ci_high FROM kivi_delta_stats d JOIN runs USING (run_id) "
                                  "WHERE kind = 'nightly' AND workload = 'gsm8k' AND cache = $1 ORDER BY started_at", [K2])
    assert np.allclose(whiskers(ax, 1), [(r["ci_low"], r["ci_high"]) for r in intervals])
    trend, star = (line for line in ax.lines if line.get_linestyle() == "--" or line.get_marker() == "*")
    assert trend.get_ydata()[-1] < trend.get_ydata()[0]  # the drift down shows as a falling line
    assert (star.get_xdata().tolist(), star.get_ydata().tolist()) == ([3], [-10])


def test_an_ungated_run_plots_every_delta_and_an_older_run_only_what_came_before(nightlies, tmp_path, monkeypatch) -> None:
    figures = figures_of(nightlies, "nightly-1", tmp_path, monkeypatch)
    assert [ax.get_title().split(":")[0] for ax in figures["history.png"].axes] == [f"gsm8k · {K2}", f"gsm8k · {K4}"]
    for ax in figures["history.png"].axes:  # nightly-a and nightly-1: nightly-2 and -3 came later
        (points,) = [c for c in ax.collections if not isinstance(c, LineCollection)]
        assert points.get_offsets()[:, 0].tolist() == [0, 1]


def test_a_run_without_earlier_runs_says_so_in_one_line(report: Path) -> None:
    section = report.read_text().split("## History: smollm2-135m, nightly runs\n\n", 1)[1].split("\n\n", 1)[0]
    assert section == "No earlier run of smollm2-135m labelled nightly in the archive: no history yet."


def test_a_delta_without_an_interval_names_no_test_beside_it(root: str, tmp_path: Path) -> None:
    writer = ArchiveWriter(root, "one")
    for cache, score in ((FP16, 1.0), (K2, 0.76)):  # one request, scored as a fraction: no bootstrap, no McNemar
        writer.write_results("fidelity", cache, 0, [{"model": "m", "workload_version": 1, "task": "fidelity",
                                                      "request_id": "f0", "score": score, "metric": "top1_agreement"}])
    with Store(root) as store:
        text = write_report(store, "one", tmp_path / "out").read_text()
    assert f"| fidelity | {K2} | 100.00 | 76.00 | -24.00   | –      | – | –    | 1       |" in text
    assert "moves -24.00 points on fidelity (one cluster: no interval, so not a finding)" in text
