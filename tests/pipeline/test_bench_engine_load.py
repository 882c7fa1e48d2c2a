"""tools.bench_engine_load at a tiny size on the CPU: the load it builds, every run of it, this tree against a
baseline tree (here the same checkout) in child processes, and the table's bound."""

import argparse
import json

import pytest

from tools import bench_engine_load
from tools.trees import REPO

pytestmark = pytest.mark.slow


def test_the_load_benchmark_runs_every_cache_and_slot_count_on_both_trees(tmp_path, capsys):
    out = tmp_path / "load.json"
    bench_engine_load.main(["--shape", "tiny", "--prompts", "5", "--prompt-min", "8", "--prompt-max", "24",
                            "--new-median", "4", "--new-min", "2", "--new-max", "6", "--slots", "2", "4", "--bare", "1",
                            "--baseline-tree", str(REPO), "--baseline-slots", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    load = bench_engine_load.make_load(argparse.Namespace(
        shape="tiny", prompts=5, prompt_min=8, prompt_max=24, new_median=4, new_sigma=0.4, new_min=2, new_max=6, seed=0))
    runs = {tree: [(r["cache"], r["slots"]) for r in result["runs"][tree]["rows"]] for tree in ("new", "baseline")}
    assert runs == {"new": [("fp16", 2), ("fp16", 4), ("kivi-2", 2), ("kivi-2", 4)], "baseline": [("fp16", 2), ("kivi-2", 2)]}
    for tree in ("new", "baseline"):
        for row in result["runs"][tree]["rows"]:  # every sequence ran to its own max_new_tokens, no EOS
            assert row["new_tokens"] == sum(load["new"]) and row["prompt_tokens"] == sum(map(len, load["prompts"]))
            assert row["steps"] > 0 and row["prefill_s"] > 0
        assert result["runs"][tree]["bare_tokens_per_s"] > 0
    table = capsys.readouterr().out.splitlines()
    assert sum(line.split()[:2] in (["new", "engine"], ["baseline", "engine"]) for line in table) == 6
