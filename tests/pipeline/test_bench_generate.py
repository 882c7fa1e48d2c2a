"""tools.bench_generate at a tiny size on the CPU: every figure measured and written, every token counted, the sampled
rows drawn the same twice; and it imports nothing a GPU host lacks (Ray, DuckDB, pydantic, datasets)."""

import json
import subprocess
import sys
from collections import Counter

from pipeline.models import load_tokenizer
from pipeline.sharegpt_pairs import LOCAL_PATTERN, LengthLimits, sample_pairs
from tools.bench_generate import main


def test_the_benchmark_counts_every_generated_token_beside_its_sweep_point_and_writes_json(
        tiny_model_folder, data_dir, tmp_path, capsys):
    path = tmp_path / "bench.json"
    out = main(["--model", str(tiny_model_folder(64, vocab_size=2048)), "--data-dir", str(data_dir), "--n", "10", "--batch", "4",
                "--shard-size", "6", "--max-new-tokens", "5", "--sampled", "4", "--device", "cpu", "--json", str(path)])
    assert json.loads(path.read_text()) == out
    (sharegpt,) = (data_dir / "sharegpt").glob(LOCAL_PATTERN)
    pairs = sample_pairs(json.loads(sharegpt.read_text()), load_tokenizer("smollm2-135m"), 10, 0, LengthLimits(), 2048,
                         Counter())
    assert out["n"] == out["distinct_prompts"] == 10
    for name in ("fp16", "kivi-2"):
        cache = out["caches"][name]
        generated, sweep = cache["generation"], cache["sweep"]
        assert generated["output_tokens"] == sum(min(p.output_len, 5) for p in pairs)  # EOS ends no row
        assert generated["admissions"] == 10 and generated["tokens_per_s"] > 0 and generated["wall_s"] > 0
        assert (sweep["batch"], sweep["gen_len"]) == (4, 5) and sweep["tokens_per_s"] > 0
        assert cache["sweep_over_generation"] == sweep["tokens_per_s"] / generated["tokens_per_s"]
        assert cache["sampling_check"] == {"rows": 4, "identical": 4}
    table = capsys.readouterr().out.splitlines()
    assert table[-3].split()[:2] == ["cache", "gen"] and [line.split()[0] for line in table[-2:]] == ["fp16", "kivi-2"]


def test_the_benchmark_imports_nothing_a_gpu_host_lacks():
    code = ("import sys, tools.bench_generate\n"
            "print([m for m in ('ray', 'duckdb', 'pydantic', 'datasets') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
