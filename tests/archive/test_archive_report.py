"""The markdown report: sections with the hand-computed numbers, PNGs that decode, sections left out without data."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
from archive_files import copy
from synthetic_archive import K2, K4, write_gsm8k

from pipeline import report as report_module
from pipeline.archive import FP16, ArchiveWriter
from pipeline.gate import evaluate, load_gate, write_verdicts
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


def test_the_score_table_shows_fp16_kivi_and_the_delta_in_points(report: Path) -> None:
    text = report.read_text()
    assert f"| gsm8k     | {K2} | 70.00 | 65.00 | -5.00" in text
    assert f"| longbench | {K2} | 50.00 | 49.25 | -0.75" in text


def test_longbench_gets_a_per_task_table_with_each_task_delta(report: Path) -> None:
    text = report.read_text()
    section = text.split("### longbench per task", 1)[1].split("\n\n", 2)[1]
    assert f"| narrativeqa | qa_f1          | {K2} | 50.00 | 47.75 | -2.25" in section
    assert "### gsm8k per task" not in text  # one task: the workload row says it all


def test_each_niah_heatmap_cell_carries_its_score_as_text(shared_archive: str, tmp_path: Path, monkeypatch) -> None:
    figures = {}
    monkeypatch.setattr(report_module, "_save", lambda fig, path: figures.setdefault(path.name, fig))
    with Store(shared_archive) as store:
        write_report(store, "nightly-a", tmp_path)
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


def test_the_header_verdicts_skipped_counts_and_config_are_reported(report: Path) -> None:
    text = report.read_text()
    assert "# KIVI evaluation: `nightly-a`" in text and "| transformers | 5.17.0" in text and "| status       | complete" in text
    assert "**FAIL**" in text
    assert "| longbench | empty context     | 1" not in text and "| longbench | empty context     | 2" in text
    assert "```yaml\nmodel: smollm2-135m" in text
    assert "| actor 0      | node1 pid 7 cuda GPU 1 (22c5e003…): 9 jobs, ready after 21.4 s (constructor 9.8 s)" in text


def test_the_gate_section_shows_each_rules_file_under_its_own_heading(report: Path) -> None:
    text = report.read_text()
    nightly, smoke = (f"## Gate {name} (`{REPO / 'configs/gates' / name}.yaml`)" for name in ("nightly", "smoke"))
    assert f"{nightly}: 4 of 6 verdicts passed" in text and f"{smoke}: 3 of 5 verdicts passed" in text
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
