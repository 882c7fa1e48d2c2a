"""A synthetic archive with hand-computable scores: two runs of gsm8k, LongBench, NIAH and a ShareGPT sweep.

Run "nightly-a" (the baseline), per cache (fp16 / kivi-2 / kivi-4):
- gsm8k, 20 requests in 2 shards: 14 / 13 / 14 correct (kivi-2 errors on g05) -> Δ -5.00 and +0.00 points.
- longbench: narrativeqa (4 requests) 0.5 / 0.4775 / 0.5, gov_report (2) 0.25, trec (4) 0.75;
  average of task means 0.5 / 0.4925 / 0.5 -> Δ -0.75 (narrativeqa task Δ -2.25); request mean would be 0.55.
- niah, 3 lengths × 3 depths: kivi-2 loses cell (4096, 0.5); kivi-4 equals fp16.
- sharegpt perf: fp16 best 320 tokens/s at batch 16 (OOM at 32); kivi-2 1000 at 64 (3.125×); kivi-4 560 at 32 (1.75×).
Run "canary-b" (baseline nightly-a): as nightly-a except kivi-2 gets gsm8k 14 right, narrativeqa 0.5,
gov_report 0.235 (-1.50 points vs the baseline), and perf for fp16 and kivi-2 only (kivi-4 has none).
"""

from __future__ import annotations

import datetime as dt

from pipeline.archive import ArchiveWriter
from pipeline.names import FP16

K2 = "kivi-k2v2-g32-r128"
K4 = "kivi-k4v4-g32-r128"
MODEL = "smollm2-135m"
STARTED = dt.datetime(2025, 6, 1, 2, 0, tzinfo=dt.UTC)
QUANT = {FP16: (None, None, None, None), K2: (2, 2, 32, 128), K4: (4, 4, 32, 128)}
LENGTHS, DEPTHS = (1024, 2048, 4096), (0.0, 0.5, 1.0)
# As the runs' config would read (fidelity planned: its rows are missing, as after a failed shard).
CONFIG_YAML = """model: {spec: smollm2-135m}
caches: [kivi-2, kivi-4]
workloads:
  gsm8k: {n: 20}
  longbench: {tasks: [narrativeqa, gov_report, trec], n: 4}
  niah: {tasks: [niah], lengths: [1024, 2048, 4096], depths: [0.0, 0.5, 1.0]}
  fidelity: {n: 8}
  sharegpt: {n: 64}
"""


def result_row(cache: str, task: str, request_id: str, score: float | None, metric: str, **extra) -> dict:
    k_bits, v_bits, group, residual = QUANT[cache]
    return {
        "started_at": STARTED, "git_sha": "0123abc", "model": MODEL, "task": task, "request_id": request_id,
        "k_bits": k_bits, "v_bits": v_bits, "group_size": group, "residual_length": residual,
        "prompt_tokens": 200, "output_tokens": 40, "prediction": "…", "reference": '["42"]',
        "score": score, "metric": metric, "latency_s": 0.5, **extra,
    }


def write_gsm8k(writer: ArchiveWriter, cache: str, correct: int, errored: tuple[int, ...] = (), shards=(0, 1),
                version: int = 3) -> None:
    """Requests g00..g19, ten per shard; the first `correct` are right."""
    for shard in shards:
        rows = []
        for i in range(shard * 10, shard * 10 + 10):
            if i in errored:
                rows.append(result_row(cache, "gsm8k", f"g{i:02d}", None, "exact_match", error="RuntimeError: boom"))
            else:
                rows.append(result_row(cache, "gsm8k", f"g{i:02d}", float(i < correct), "exact_match"))
        writer.write_results("gsm8k", cache, shard, [{**r, "workload_version": version} for r in rows])


def write_longbench(writer: ArchiveWriter, cache: str, scores: dict[str, list[float]]) -> None:
    metrics = {"narrativeqa": "qa_f1", "gov_report": "rouge_l", "trec": "classification"}
    rows = [result_row(cache, task, f"{task}-{i}", s, metrics[task], workload_version=1)
            for task, values in scores.items() for i, s in enumerate(values)]
    writer.write_results("longbench", cache, 0, rows)


def write_niah(writer: ArchiveWriter, cache: str, lost: tuple[tuple[int, float], ...]) -> None:
    rows = [result_row(cache, "niah", f"L{n}-d{d:g}", float((n, d) not in lost), "needle_recall", workload_version=1,
                       meta={"context_length": n, "depth": d})
            for n in LENGTHS for d in DEPTHS]
    writer.write_results("niah", cache, 0, rows)


def write_sweep(writer: ArchiveWriter, cache: str, tokens_per_s: list[float], bytes_per_element: float) -> None:
    rows = []
    for i, tps in enumerate([*tokens_per_s, None]):  # the batch after the last measurement runs out of memory
        batch = 2**i
        fp16_kv = batch * 1_000_000
        rows.append({
            "model": MODEL, "cache": cache, "workload": "sharegpt", "batch_size": batch, "prompt_len": 512, "gen_len": 128,
            "tokens_per_s": tps, "peak_mem_bytes": None if tps is None else (2 + batch) * 2**30,
            "kv_bytes": int(fp16_kv * bytes_per_element / 2), "fp16_kv_bytes": fp16_kv, "oom": tps is None, "device": "H200",
        })
    writer.write_perf(rows)


BASE_LONGBENCH = {"narrativeqa": [0.5, 0.25, 0.75, 0.5], "gov_report": [0.3, 0.2], "trec": [1.0, 1.0, 0.0, 1.0]}
FP16_SWEEP = [30, 58, 110, 200, 320]
K2_SWEEP = [28, 55, 105, 195, 350, 600, 1000]
K4_SWEEP = [29, 56, 108, 198, 340, 560]


def build_archive(root: str) -> str:
    """The two runs under ``root`` (a folder or a URI); returns it."""
    a = ArchiveWriter(root, "nightly-a")
    a.write_run({"kind": "nightly", "model": MODEL, "git_sha": "0123abc", "config_yaml": CONFIG_YAML, "started_at": STARTED,
                 "versions": {"torch": "2.13.0", "transformers": "5.17.0", "triton": "3.6.0", "kernel": "k3-9f2e"}})
    write_gsm8k(a, FP16, correct=14)
    write_gsm8k(a, K2, correct=14, errored=(5,))
    write_gsm8k(a, K4, correct=14)
    write_longbench(a, FP16, BASE_LONGBENCH)
    write_longbench(a, K2, {**BASE_LONGBENCH, "narrativeqa": [0.5, 0.25, 0.75, 0.41]})
    write_longbench(a, K4, BASE_LONGBENCH)
    write_niah(a, FP16, lost=((4096, 1.0),))
    write_niah(a, K2, lost=((4096, 1.0), (4096, 0.5)))
    write_niah(a, K4, lost=((4096, 1.0),))
    write_sweep(a, FP16, FP16_SWEEP, 2.0)
    write_sweep(a, K2, K2_SWEEP, 0.375)
    write_sweep(a, K4, K4_SWEEP, 0.625)
    a.update_run_status("complete", skipped={"longbench": {"empty context": 2}, "gsm8k": {"no numeric answer": 1}},
                        placements=[{"host": "node1", "pid": 7, "device": "cuda", "ray_gpu_ids": ["1"],
                                     "gpu_uuid": "22c5e003-4887-0110-d030-ff6642917d1a", "load_s": 9.8, "ready_s": 21.4,
                                     "jobs": 9}])

    b = ArchiveWriter(root, "canary-b")
    b.write_run({"kind": "canary", "model": MODEL, "baseline_run_id": "nightly-a", "config_yaml": CONFIG_YAML})
    for cache in (FP16, K2, K4):
        write_gsm8k(b, cache, correct=14)
    write_longbench(b, FP16, BASE_LONGBENCH)
    write_longbench(b, K2, {**BASE_LONGBENCH, "gov_report": [0.3, 0.17]})
    write_longbench(b, K4, BASE_LONGBENCH)
    write_niah(b, FP16, lost=((4096, 1.0),))
    write_niah(b, K2, lost=((4096, 1.0), (4096, 0.5)))
    write_niah(b, K4, lost=((4096, 1.0),))
    write_sweep(b, FP16, FP16_SWEEP, 2.0)
    write_sweep(b, K2, K2_SWEEP, 0.375)
    b.update_run_status("complete")
    return root
