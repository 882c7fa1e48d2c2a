"""Markdown report of one run with PNG plots: scores and deltas, NIAH heatmaps, throughput, verdicts.

Scores are shown in points (score × 100) and deltas as signed points, the units of pipeline.store.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pipeline.archive import FP16
from pipeline.store import Store, format_table

_GIB = 2**30


def write_report(store: Store, run_id: str, out_dir: str | os.PathLike[str]) -> Path:
    """Write ``out_dir/report.md`` and its PNGs for ``run_id``; sections without data are left out."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections = [
        _header(store, run_id),
        _scores(store, run_id, out),
        _niah(store, run_id, out),
        _throughput(store, run_id, out),
        _verdicts(store, run_id),
        _skipped(store, run_id),
        _config(store, run_id),
    ]
    path = out / "report.md"
    path.write_text("\n\n".join(s for s in sections if s) + "\n")
    return path


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    return format_table(columns, rows, floatfmt=".2f", null="–")


def _pts(score: float | None) -> float | None:
    return None if score is None else 100 * score


def _signed(delta: float | None) -> str:
    return "–" if delta is None else f"{delta:+.2f}"


def _manifest(store: Store, run_id: str) -> dict[str, Any] | None:
    rows = store.records("SELECT * FROM runs WHERE run_id = $1", [run_id])
    return rows[0] if rows else None


def _header(store: Store, run_id: str) -> str:
    run = _manifest(store, run_id) or {}
    model = run.get("model") or store.query("SELECT any_value(model) FROM results WHERE run_id = $1", [run_id])[1][0][0]
    fields = [("kind", run.get("kind")), ("status", run.get("status") or "no manifest row"), ("model", model),
              ("git sha", run.get("git_sha")), ("started", run.get("started_at")), ("finished", run.get("finished_at")),
              ("baseline run", run.get("baseline_run_id"))]
    fields += sorted(json.loads(run.get("versions") or "{}").items())
    fields += [(f"actor {i}", _actor(p)) for i, p in enumerate(json.loads(run.get("placements") or "[]"))]
    shown = [(k, v.isoformat(sep=" ", timespec="seconds") if isinstance(v, dt.datetime) else v) for k, v in fields]
    partial = ""
    if run.get("status") != "complete":  # what follows covers only what the run wrote before it stopped
        why = f"the run failed: {run['error']}" if run.get("error") else f"the run is {run.get('status') or 'unknown'}"
        partial = f"**Partial results: {why}. Scores, deltas and verdicts below cover what it wrote.**\n\n"
    return f"# KIVI evaluation: `{run_id}`\n\n{partial}" + _table(["field", "value"], shown)


def _actor(placement: dict[str, Any]) -> str:
    gpu = f" GPU {','.join(placement['ray_gpu_ids'])}" if placement["ray_gpu_ids"] else ""
    uuid = f" ({placement['gpu_uuid'][:8]}…)" if placement["gpu_uuid"] else ""
    ready = f", ready after {placement['ready_s']} s (constructor {placement['load_s']} s)" if "ready_s" in placement else ""
    return f"{placement['host']} pid {placement['pid']} {placement['device']}{gpu}{uuid}: {placement['jobs']} jobs{ready}"


def _scores(store: Store, run_id: str, out: Path) -> str:
    rows = store.records("SELECT * FROM kivi_deltas WHERE run_id = $1 ORDER BY workload, cache", [run_id])
    if not rows:
        return ""
    text = "## Scores: fp16 vs KIVI (points; Δ = KIVI − fp16)\n\n" + _table(
        ["workload", "cache", "fp16", "KIVI", "Δ points", "n pairs", "n fp16", "n cache"],
        [(r["workload"], r["cache"], _pts(r["fp16_score"]), _pts(r["kivi_score"]), _signed(r["delta_points"]),
          r["n_pairs"], r["n_fp16"], r["n_cache"]) for r in rows])
    tasks = store.records(
        """SELECT d.*, t.metric FROM kivi_task_deltas d
           JOIN task_scores t ON t.run_id = d.run_id AND t.workload = d.workload AND t.task = d.task AND t.cache = d.cache
           WHERE d.run_id = $1 ORDER BY d.workload, d.task, d.cache""", [run_id])
    for workload in sorted({t["workload"] for t in tasks}):
        mine = [t for t in tasks if t["workload"] == workload]
        if len({t["task"] for t in mine}) > 1:  # single-task workloads are already the row above
            text += f"\n\n### {workload} per task\n\n" + _table(
                ["task", "metric", "cache", "fp16", "KIVI", "Δ points", "n"],
                [(t["task"], t["metric"], t["cache"], _pts(t["fp16_score"]), _pts(t["kivi_score"]),
                  _signed(t["delta_points"]), t["n_pairs"]) for t in mine])
    _delta_bars(tasks, out / "deltas.png")
    return text + "\n\n![Per-task Δ points, KIVI − fp16](deltas.png)"


def _delta_bars(tasks: list[dict[str, Any]], path: Path) -> None:
    labels = sorted({(t["workload"], t["task"]) for t in tasks})
    caches = sorted({t["cache"] for t in tasks})
    delta = {(t["workload"], t["task"], t["cache"]): t["delta_points"] for t in tasks}
    fig = Figure(figsize=(8, 1.2 + 0.3 * len(labels) * len(caches)), layout="constrained")
    ax = fig.add_subplot()
    height = 0.8 / len(caches)
    y = np.arange(len(labels))
    for i, cache in enumerate(caches):
        values = [delta.get((w, t, cache), np.nan) for w, t in labels]
        bars = ax.barh(y + i * height, values, height, label=cache)
        # A zero delta draws no bar; the number says it was measured.
        ax.bar_label(bars, ["" if np.isnan(v) else f"{v:+.2f}" for v in values], padding=2, fontsize="x-small")
    # Bars stick to x = 0, so pad the limits by hand to leave room for the labels on both sides.
    known = [v for v in delta.values() if v is not None]
    low, high = min([0.0, *known]), max([0.0, *known])
    pad = 0.2 * max(high - low, 1.0)
    ax.set_xlim(low - pad, high + pad)
    ax.set_yticks(y + height * (len(caches) - 1) / 2, [t if t == w else f"{w}/{t}" for w, t in labels])
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("Δ points (KIVI − fp16)")
    ax.legend(fontsize="small")
    _save(fig, path)


def _niah(store: Store, run_id: str, out: Path) -> str:
    cells = store.records("SELECT * FROM niah_cells WHERE run_id = $1", [run_id])
    parts = []
    for workload, task in sorted({(c["workload"], c["task"]) for c in cells}):
        mine = [c for c in cells if (c["workload"], c["task"]) == (workload, task)]
        name = re.sub(r"[^A-Za-z0-9._-]", "_", f"niah-{workload}-{task}.png")
        _heatmaps(mine, out / name)
        parts.append(f"![{workload}/{task}: score per context length × depth]({name})")
    return "## Needle in a haystack\n\n" + "\n\n".join(parts) if parts else ""


def _heatmaps(cells: list[dict[str, Any]], path: Path) -> None:
    caches = sorted({c["cache"] for c in cells}, key=lambda c: (c != FP16, c))  # fp16 first, as the reference
    lengths = sorted({c["context_length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    fig = Figure(figsize=(0.6 + 3.2 * len(caches), 0.8 + 0.35 * len(depths)), layout="constrained")
    axes = fig.subplots(1, len(caches), squeeze=False)[0]
    for ax, cache in zip(axes, caches, strict=True):
        grid = np.full((len(depths), len(lengths)), np.nan)  # a cell not run stays blank, not 0
        for c in cells:
            if c["cache"] == cache:
                grid[depths.index(c["depth"]), lengths.index(c["context_length"])] = c["score"]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (row, col), score in np.ndenumerate(grid):  # the value itself: colour alone hides 0.67 against 0.75
            if not np.isnan(score):
                ax.text(col, row, f"{score:.2f}", ha="center", va="center", fontsize="x-small",
                        color="white" if score < 0.2 or score > 0.8 else "black")  # legible on dark red and green
        ax.set_title(cache, fontsize="small")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45, fontsize="x-small")
        ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths], fontsize="x-small")
        ax.set_xlabel("context length (tokens)")
    axes[0].set_ylabel("needle depth")
    fig.colorbar(image, ax=list(axes), label="score")
    _save(fig, path)


def _throughput(store: Store, run_id: str, out: Path) -> str:
    summary = store.records("SELECT * FROM throughput WHERE run_id = $1 ORDER BY workload, cache", [run_id])
    if not summary:
        return ""
    points = store.records("SELECT * FROM perf WHERE run_id = $1 ORDER BY cache, batch_size", [run_id])
    _sweep_plot(points, out / "throughput.png")
    return "## Throughput sweep\n\n" + _table(
        ["workload", "cache", "max batch", "first OOM batch", "max tokens/s", "× fp16 tokens/s", "× fp16 batch",
         "KV compression", "device"],
        [(r["workload"], r["cache"], r["max_batch"], r["first_oom_batch"], r["max_tokens_per_s"], r["throughput_ratio"],
          r["batch_ratio"], r["kv_compression"], r["device"]) for r in summary]
    ) + "\n\n![Tokens/s and peak memory vs batch size; × marks OOM](throughput.png)"


def _sweep_plot(points: list[dict[str, Any]], path: Path) -> None:
    # Peak memory is measured on GPUs only (CPU runs leave it null): no empty panel for it.
    panels = [("tokens_per_s", 1, "tokens/s")]
    if any(p["peak_mem_bytes"] for p in points):
        panels.append(("peak_mem_bytes", _GIB, "peak memory (GiB)"))
    fig = Figure(figsize=(5.5 * len(panels), 4), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for i, cache in enumerate(sorted({p["cache"] for p in points}, key=lambda c: (c != FP16, c))):
        mine = [p for p in points if p["cache"] == cache]
        ok = [p for p in mine if not p["oom"]]
        oom = [p["batch_size"] for p in mine if p["oom"]]
        for ax, (column, unit, _) in zip(axes, panels):
            ax.plot([p["batch_size"] for p in ok], [(p[column] or np.nan) / unit for p in ok], "o-", color=f"C{i}", label=cache)
            # OOM has no measurement; mark the batch size on the x axis instead.
            ax.plot(oom, [0] * len(oom), "x", color=f"C{i}", markersize=10, markeredgewidth=2, clip_on=False)
    for ax, (_, _, label) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch size (× = OOM)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    _save(fig, path)


def _verdicts(store: Store, run_id: str) -> str:
    """One section per rules file the run was gated with: a nightly gate does not hide the smoke gate's verdicts."""
    rows = store.records("SELECT * FROM verdicts WHERE run_id = $1 ORDER BY rules NULLS LAST, rule, cache", [run_id])
    sections = []
    for rules, group in itertools.groupby(rows, key=lambda r: r["rules"]):
        group = list(group)
        # Archives from before verdicts were kept per rules file hold one set with no rules recorded.
        source = f"{rules} (`{group[0]['rules_path']}`)" if rules else "(rules file not recorded)"
        table = _table(["rule", "kind", "cache", "observed", "threshold", "result", "detail"],
                       [(r["rule"], r["kind"], r["cache"], r["observed"], r["threshold"],
                         "pass" if r["passed"] else "**FAIL**", r["detail"]) for r in group])
        passed = sum(r["passed"] for r in group)
        sections.append(f"## Gate {source}: {passed} of {len(group)} verdicts passed\n\n{table}")
    return "\n\n".join(sections)


def _skipped(store: Store, run_id: str) -> str:
    run = _manifest(store, run_id) or {}
    counts = json.loads(run.get("skipped") or "{}")
    rows = [(w, reason, n) for w, reasons in sorted(counts.items()) for reason, n in sorted(reasons.items())]
    return "## Skipped records\n\n" + _table(["workload", "reason", "count"], rows) if rows else ""


def _config(store: Store, run_id: str) -> str:
    run = _manifest(store, run_id) or {}
    return f"## Configuration\n\n```yaml\n{run['config_yaml'].rstrip()}\n```" if run.get("config_yaml") else ""


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)  # Agg: no display needed, same PNGs on a laptop and on a cluster node
    fig.savefig(path, dpi=110)
