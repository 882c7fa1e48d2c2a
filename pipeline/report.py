"""Markdown report of one run with PNG plots: a summary, scores and deltas, NIAH heatmaps, throughput, generations,
verdicts, history.

Scores are shown in points (score × 100) and deltas as signed points, the units of pipeline.store; every
delta carries its paired 95% interval and p-value from the store's *_delta_stats views.
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
from matplotlib.lines import Line2D

from kivi.config import cache_presets
from pipeline.history import delta_history, gated_metrics
from pipeline.names import FP16
from pipeline.store import Store, format_table

_GIB = 2**30


def write_report(store: Store, run_id: str, out_dir: str | os.PathLike[str]) -> Path:
    """Write ``out_dir/report.md`` and its PNGs for ``run_id``; sections without data are left out."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections = [
        _header(store, run_id),
        _summary(store, run_id),
        _scores(store, run_id, out),
        _niah(store, run_id, out),
        _throughput(store, run_id, out),
        _generations(store, run_id, out),
        _verdicts(store, run_id),
        _history(store, run_id, out),
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


def _interval(row: dict[str, Any]) -> str:
    return "–" if row["ci_low"] is None else f"[{row['ci_low']:+.2f}, {row['ci_high']:+.2f}]"  # None: one cluster


def _p(row: dict[str, Any]) -> str:
    return "–" if row["p_value"] is None else f"{row['p_value']:.2g}"


def _test(row: dict[str, Any]) -> str:
    return "–" if row["p_value"] is None else row["test"]  # one cluster: no bootstrap was drawn


def _column(rows: list[dict[str, Any] | None], key: str) -> np.ndarray:
    """``key`` of each row as floats, NaN where the row or its value is missing (a cache without that task, one cluster)."""
    return np.array([np.nan if r is None or r[key] is None else r[key] for r in rows], dtype=float)


def _manifest(store: Store, run_id: str) -> dict[str, Any] | None:
    rows = store.records("SELECT * FROM runs WHERE run_id = $1", [run_id])
    return rows[0] if rows else None


def _header(store: Store, run_id: str) -> str:
    run = _manifest(store, run_id) or {}
    model = run.get("model") or store.query("SELECT any_value(model) FROM results WHERE run_id = $1", [run_id])[1][0][0]
    fields = [("kind", run.get("kind")), ("label", run.get("label") or run.get("kind")),
              ("status", run.get("status") or "no manifest row"), ("model", model),
              ("git sha", run.get("git_sha")), ("started", run.get("started_at")), ("finished", run.get("finished_at")),
              ("baseline run", run.get("baseline_run_id"))]
    fields += sorted(json.loads(run.get("versions") or "{}").items())
    fields += [(f"actor {i}", actor_line(p)) for i, p in enumerate(json.loads(run.get("placements") or "[]"))]
    shown = [(k, v.isoformat(sep=" ", timespec="seconds") if isinstance(v, dt.datetime) else v) for k, v in fields]
    partial = ""
    if run.get("status") != "complete":  # what follows covers only what the run wrote before it stopped
        why = f"the run failed: {run['error']}" if run.get("error") else f"the run is {run.get('status') or 'unknown'}"
        partial = f"**Partial results: {why}. Scores, deltas and verdicts below cover what it wrote.**\n\n"
    return f"# KIVI evaluation: `{run_id}`\n\n{partial}" + _table(["field", "value"], shown)


def actor_line(placement: dict[str, Any]) -> str:
    """Where an actor ran, the jobs it finished and its start-up seconds, in one line."""
    gpu = f" GPU {','.join(placement['ray_gpu_ids'])}" if placement["ray_gpu_ids"] else ""
    uuid = f" ({placement['gpu_uuid'][:8]}…)" if placement["gpu_uuid"] else ""
    ready = f", ready after {placement['ready_s']} s (constructor {placement['load_s']} s)" if "ready_s" in placement else ""
    return f"{placement['host']} pid {placement['pid']} {placement['device']}{gpu}{uuid}: {placement['jobs']} jobs{ready}"


def _summary(store: Store, run_id: str) -> str:
    """One paragraph to act on: what each KIVI cache loses against fp16 beyond its interval, what the gates said,
    how large a loss these sample sizes can see, and whether the throughput means anything on this device."""
    deltas = store.records("SELECT workload, cache, delta_points, ci_low, ci_high, mde_points, n_pairs "
                           "FROM kivi_delta_stats WHERE run_id = $1 ORDER BY cache, workload", [run_id])
    if not deltas:
        return ""
    sentences = [_cache_sentence(cache, [d for d in deltas if d["cache"] == cache])
                 for cache in dict.fromkeys(d["cache"] for d in deltas)]
    sentences += _gate_sentences(store, run_id)
    # A detectable effect of 0 means no pair differed: it bounds nothing.
    if widest := max((d for d in deltas if d["mde_points"]), key=lambda d: d["mde_points"], default=None):
        sentences.append(f"At these sample sizes the smallest loss found with 80% power is up to "
                         f"{widest['mde_points']:.1f} points ({widest['workload']} on {widest['cache']}): a match rules "
                         "out only losses that large.")
    sentences += _throughput_sentences(store, run_id)
    return "## Summary\n\n" + " ".join(sentences)


def _named(cache: str) -> str:
    """A cache as configs name it (its preset) beside its archive name."""
    preset = cache_presets().get(cache)
    return f"**{preset}** (`{cache}`)" if preset else f"**{cache}**"


def _cache_sentence(cache: str, rows: list[dict[str, Any]]) -> str:
    """What a cache does against fp16 per workload: a loss or gain its interval shows, a move it does not (not
    significant at that n), a match (inside the interval and within a point), or a single value without interval."""
    alone = [r for r in rows if r["ci_low"] is None]
    shown = [r for r in rows if r not in alone and (r["ci_high"] < 0 or r["ci_low"] > 0)]
    unsure = [r for r in rows if r not in alone + shown and abs(r["delta_points"]) >= _MATCH_POINTS]
    matched = [r for r in rows if r not in alone + shown + unsure]
    parts = [f"{verb} " + _and([f"{abs(r['delta_points']):.2f} points on {r['workload']} {_interval(r)}" for r in group])
             for verb, group in (("loses", [r for r in shown if r["delta_points"] < 0]),
                                 ("gains", [r for r in shown if r["delta_points"] > 0])) if group]
    parts += [f"{verb} " + _and([f"{abs(r['delta_points']):.2f} points on {r['workload']}, not significantly at "
                                 f"n = {r['n_pairs']} {_interval(r)}" for r in group])
              for verb, group in (("drops", [r for r in unsure if r["delta_points"] < 0]),
                                  ("rises", [r for r in unsure if r["delta_points"] > 0])) if group]
    if matched:
        parts.append(f"matches fp16 (within a point, inside its 95% interval) on {_and([r['workload'] for r in matched])}")
    if alone:
        parts.append("moves " + _and([f"{r['delta_points']:+.2f} points on {r['workload']}" for r in alone])
                     + " (one cluster: no interval, so not a finding)")
    return f"{_named(cache)} {'; it '.join(parts)}."


def _gate_sentences(store: Store, run_id: str) -> list[str]:
    rows = store.records("SELECT rules, rule, cache, passed FROM verdicts WHERE run_id = $1 "
                         "ORDER BY rules NULLS LAST, rule, cache", [run_id])
    if not rows:
        return ["The run was not gated."]
    out = []
    for rules, group in itertools.groupby(rows, key=lambda r: r["rules"]):
        group = list(group)
        failed = [r["rule"] + (f" on {r['cache']}" if r["cache"] else "") for r in group if not r["passed"]]
        name = f"Gate {rules}" if rules else "The gate"
        out.append(f"{name} failed {len(failed)} of {len(group)} verdicts ({_and(failed[:_LISTED])}{', …' * (len(failed) > _LISTED)})."
                   if failed else f"{name} passed {f'all {len(group)} verdicts' if len(group) > 1 else 'its verdict'}.")
    return out


def _throughput_sentences(store: Store, run_id: str) -> list[str]:
    rows = store.records("SELECT cache, device, throughput_ratio, batch_ratio FROM throughput "
                         f"WHERE run_id = $1 AND cache <> '{FP16}' AND throughput_ratio IS NOT NULL ORDER BY cache", [run_id])
    if not rows:
        return []
    ratios = _and([f"{_named(r['cache'])} {r['throughput_ratio']:.2f}×" for r in rows])
    if any(r["device"] == "cpu" for r in rows):
        return [f"Throughput ({ratios} fp16's tokens/s) was measured on a CPU: {_CPU_THROUGHPUT}"]
    return [f"Throughput: {ratios} fp16's best tokens/s, at " + _and([f"{r['batch_ratio']:.2f}×" for r in rows])
            + " its largest batch."]


# Why a CPU's throughput says nothing of KIVI's speed, for the summary and the throughput section.
_CPU_THROUGHPUT = ("there KIVI runs on the PyTorch reference path, which dequantizes its cache at every step (on an idle "
                   "CPU it is slower than fp16), and the timings share the cores with whatever else runs: these ratios "
                   "say nothing of KIVI's speed on a GPU, where its CUDA kernels run (BENCHMARKS.md).")
_LISTED = 3  # failing verdicts the summary names
_MATCH_POINTS = 1.0  # a delta inside its interval and smaller than this reads as a match


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


_STATS = "s.ci_low, s.ci_high, s.p_value, s.test"


def _scores(store: Store, run_id: str, out: Path) -> str:
    rows = store.records(
        f"""SELECT d.*, {_STATS} FROM kivi_deltas d JOIN kivi_delta_stats s USING (run_id, workload, cache)
            WHERE d.run_id = $1 ORDER BY d.workload, d.cache""", [run_id])
    if not rows:
        return ""
    text = ("## Scores: fp16 vs KIVI (points; Δ = KIVI − fp16, paired 95% interval and p-value)\n\n" + _table(
        ["workload", "cache", "fp16", "KIVI", "Δ points", "95% CI", "p", "test", "n pairs", "n fp16", "n cache"],
        [(r["workload"], r["cache"], _pts(r["fp16_score"]), _pts(r["kivi_score"]), _signed(r["delta_points"]),
          _interval(r), _p(r), _test(r), r["n_pairs"], r["n_fp16"], r["n_cache"]) for r in rows]))
    tasks = store.records(
        f"""SELECT d.*, t.metric, {_STATS} FROM kivi_task_deltas d
            JOIN task_scores t USING (run_id, workload, task, cache)
            JOIN kivi_task_delta_stats s USING (run_id, workload, task, cache)
            WHERE d.run_id = $1 ORDER BY d.workload, d.task, d.cache""", [run_id])
    multi_task = sorted(w for w in {t["workload"] for t in tasks} if len({t["task"] for t in tasks if t["workload"] == w}) > 1)
    for workload in multi_task:  # single-task workloads are already the row above
        text += f"\n\n### {workload} per task\n\n" + _table(
            ["task", "metric", "cache", "fp16", "KIVI", "Δ points", "95% CI", "p", "n"],
            [(t["task"], t["metric"], t["cache"], _pts(t["fp16_score"]), _pts(t["kivi_score"]),
              _signed(t["delta_points"]), _interval(t), _p(t), t["n_pairs"]) for t in tasks if t["workload"] == workload])
    # A multi-task workload's own score (LongBench's average of task means) leads its tasks in the figure.
    bars = [{**r, "label": f"{r['workload']} (all tasks)", "order": (r["workload"], "")} for r in rows
            if r["workload"] in multi_task]
    bars += [{**t, "label": t["task"] if t["task"] == t["workload"] else f"{t['workload']}/{t['task']}",
              "order": (t["workload"], t["task"])} for t in tasks]
    _delta_bars(bars, out / "deltas.png")
    return text + "\n\n![Δ points per workload and task, KIVI − fp16, with 95% intervals](deltas.png)"


def _delta_bars(bars: list[dict[str, Any]], path: Path) -> None:
    """One group of bars per `label` (in `order`), one bar per cache: delta_points with [ci_low, ci_high]."""
    labels = [label for _, label in sorted({(b["order"], b["label"]) for b in bars})]
    caches = sorted({b["cache"] for b in bars})
    by = {(b["label"], b["cache"]): b for b in bars}
    fig = Figure(figsize=(8, 1.2 + 0.3 * len(labels) * len(caches)), layout="constrained")
    ax = fig.add_subplot()
    height = 0.8 / len(caches)
    y = np.arange(len(labels))
    for i, cache in enumerate(caches):
        mine = [by.get((label, cache)) for label in labels]
        values, low, high = (_column(mine, key) for key in ("delta_points", "ci_low", "ci_high"))
        ax.barh(y + i * height, values, height, label=cache, xerr=[values - low, high - values],
                error_kw=dict(ecolor="0.25", elinewidth=0.9, capsize=2.5))
        for yi, b, v, lo, hi in zip(y + i * height, mine, values, low, high):
            if b is None:
                continue
            # The number goes past the interval's end on the bar's side, so the error bar does not cross it;
            # a zero delta draws no bar, and the number says it was measured.
            right = v >= 0
            end = np.nanmax([v, hi]) if right else np.nanmin([v, lo])
            text = f"{v:+.2f}" + (f" (n={b['n_pairs']})" if b["ci_low"] is None else "")  # n says why no whiskers
            ax.annotate(text, (end, yi), xytext=(3 if right else -3, 0), textcoords="offset points",
                        ha="left" if right else "right", va="center", fontsize="x-small")
    # Bars stick to x = 0, so pad the limits by hand to leave room for the numbers on both sides.
    ends = [x for b in bars for x in (b["delta_points"], b["ci_low"], b["ci_high"]) if x is not None]
    lowest, highest = min([0.0, *ends]), max([0.0, *ends])
    pad = 0.3 * max(highest - lowest, 1.0)
    ax.set_xlim(lowest - pad, highest + pad)
    ax.set_yticks(y + height * (len(caches) - 1) / 2, labels)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("Δ points (KIVI − fp16); whiskers: paired 95% interval")
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
    memory = _sweep_plot(points, out / "throughput.png")
    table = _table(
        ["workload", "cache", "max batch", "first OOM batch", "max tokens/s", "× fp16 tokens/s", "× fp16 batch",
         "KV bytes / fp16", "device"],
        [(r["workload"], r["cache"], r["max_batch"], r["first_oom_batch"], r["max_tokens_per_s"], r["throughput_ratio"],
          r["batch_ratio"], r["kv_compression"] and 1 / r["kv_compression"], r["device"]) for r in summary])
    capacity = max((p["prompt_len"] + p["gen_len"] for p in points if p["prompt_len"] and p["gen_len"]), default=None)
    notes = [("KV bytes / fp16: the sweep's cache (codes, scales and zeros of every position, plus the full-precision "
              "residual of the newest R tokens) over a 16-bit cache of the same capacity"
              + (f", up to {capacity} tokens per sequence here" if capacity else "")
              + ". The residual weighs most in short sequences; long ones approach the codes' own share (2-bit codes "
              "with a 16-bit scale and zero per group of 32 take 0.19 of 16 bits).")]
    if any(r["device"] == "cpu" for r in summary):
        notes.append(f"**Measured on a CPU**: {_CPU_THROUGHPUT}")
    caption = "Tokens/s and peak memory vs batch size" if memory else "Tokens/s vs batch size (peak memory is measured on GPUs only)"
    return ("## Throughput sweep\n\n" + table + "\n\n" + "\n\n".join(notes)
            + f"\n\n![{caption}; × marks OOM](throughput.png)")


def _sweep_plot(points: list[dict[str, Any]], path: Path) -> bool:
    """Draw tokens/s, and peak memory where it was measured, against the batch size; whether memory is drawn."""
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
    return len(panels) > 1


def _generations(store: Store, run_id: str, out: Path) -> str:
    """A generate run: rows, finish reasons and tokens/s per cache, its error rows, KIVI against fp16 on the same
    rows, and the output lengths."""
    order = f"ORDER BY cache <> '{FP16}', cache"
    summary = store.records(f"SELECT * FROM generation_summary WHERE run_id = $1 {order}", [run_id])
    if not summary:
        return ""
    text = "## Generations\n\n" + _table(
        ["cache", "rows", "error rows", "output tokens", "mean output tokens", "eos", "stop", "length",
         "tokens/s per actor", "actor s"],
        [(r["cache"], r["rows"], r["error_rows"], r["output_tokens"], r["mean_output_tokens"], r["eos"], r["stop"],
          r["length"], r["tokens_per_s"], r["actor_s"]) for r in summary])
    errors = store.query(f"""SELECT cache, error_code, count(*) AS rows, any_value(error) AS example FROM generations
                             WHERE run_id = $1 AND error_code IS NOT NULL GROUP BY cache, error_code {order}, error_code""", [run_id])
    if errors[1]:
        text += "\n\n### Error rows\n\n" + _table(*errors)
    agreement = store.records("SELECT * FROM generation_agreement WHERE run_id = $1 ORDER BY cache", [run_id])
    if agreement:
        text += "\n\n### KIVI against fp16 on the same rows (greedy rows)\n\n" + _table(
            ["cache", "greedy rows", "identical", "exact match", "errors", "missing", "mean first difference (token)",
             "mean KL to fp16"],
            [(a["cache"], a["greedy_rows"], a["exact"], a["exact_match"], a["cache_errors"], a["missing"],
              a["mean_first_diff"], a["mean_kl"]) for a in agreement])
    lengths = store.query(f"""SELECT cache, list(output_tokens) FROM generations WHERE run_id = $1
                              AND output_tokens IS NOT NULL GROUP BY cache {order}""", [run_id])[1]
    _length_histograms(dict(lengths), out / "generation-lengths.png")
    return text + "\n\n![Output tokens per row, per cache](generation-lengths.png)"


def _length_histograms(lengths: dict[str, list[int]], path: Path) -> None:
    fig = Figure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.add_subplot()
    top = max((max(v) for v in lengths.values() if v), default=1)
    bins = np.arange(0, top + 2) - 0.5 if top < 64 else 48  # a bar per length where lengths are few
    for i, (cache, values) in enumerate(lengths.items()):
        ax.hist(values, bins=bins, histtype="step", linewidth=1.5, color=f"C{i}", label=f"{cache} (n={len(values)})")
    ax.set_xlabel("output tokens")
    ax.set_ylabel("rows")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
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


def _history(store: Store, run_id: str, out: Path) -> str:
    """Each gated delta of the run (every delta when none is gated) over this and earlier runs of the same model
    and label (the run's series, by default its kind): an interval that drifts down over nights shows before one
    night fails its rule."""
    current = store.records("SELECT DISTINCT model, workload, cache FROM kivi_deltas WHERE run_id = $1 ORDER BY ALL", [run_id])
    if not current:
        return ""
    run = _manifest(store, run_id) or {}
    model, label = current[0]["model"], run.get("label") or run.get("kind")
    available = [(r["workload"], r["cache"]) for r in current]
    gated = [m for m in available if m in {(w, c) for _, w, c in gated_metrics(store, [run_id])}]
    metrics = gated or available
    by_id, series = {}, {}
    for workload in dict.fromkeys(w for w, _ in metrics):
        rows = delta_history(store, model, workload, label=label)
        # Up to this run: a report of an older run shows the trend as it stood then.
        rows = rows[:max(i for i, r in enumerate(rows) if r["run_id"] == run_id) + 1]
        by_id.update({r["run_id"]: r for r in rows})
        series.update({(w, c): [r for r in rows if r["cache"] == c] for w, c in metrics if w == workload})
    # Merged over workloads in delta_history's order: runs without a manifest row first, then by start.
    runs = sorted(by_id.values(), key=lambda r: (r["started_at"] is not None, r["started_at"] or 0, r["run_id"]))
    order = {r["run_id"]: i for i, r in enumerate(runs)}
    title = f"## History: {model}, {f'{label} runs' if label else 'runs of every label'}"
    if len(runs) < 2:
        return f"{title}\n\nNo earlier run of {model}{f' labelled {label}' if label else ''} in the archive: no history yet."
    trends = {m: _trend([order[r["run_id"]] for r in rows], [r["delta_points"] for r in rows]) for m, rows in series.items()}
    _history_plot(series, trends, runs, order, run_id, out / "history.png")
    text = _table(["workload", "cache", "runs", "Δ this run", "95% CI", "trend (points/run)"],
                  [(w, c, len(rows), _signed(rows[-1]["delta_points"]), _interval(rows[-1]), _slope(trends[(w, c)]))
                   for (w, c), rows in series.items()])
    what = "Each gated metric" if gated else "Every delta (the run was not gated)"
    earlier = len(runs) - 1
    return (f"{title}\n\n{what} of this run, beside the archive's {earlier} earlier run{'s' * (earlier > 1)}.\n\n{text}\n\n"
            "![Δ points over runs with 95% intervals and a least-squares trend; ★ this run](history.png)")


def _trend(x: list[int], y: list[float]) -> tuple[float, float] | None:
    """Least-squares (slope in points per run, intercept); None below two runs. For the eye, not a test."""
    if len(set(x)) < 2:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(intercept)


def _slope(trend: tuple[float, float] | None) -> str:
    return _signed(None if trend is None else trend[0])


_GATE_COLOURS = {True: ("tab:green", "gate passed"), False: ("tab:red", "gate failed"), None: ("0.6", "not gated")}


def _history_plot(series: dict[tuple[str, str], list[dict[str, Any]]],
                  trends: dict[tuple[str, str], tuple[float, float] | None],
                  runs: list[dict[str, Any]], order: dict[str, int], run_id: str, path: Path) -> None:
    """``runs`` oldest first; ``order``: each run id's place in them."""
    fig = Figure(figsize=(min(14.0, 5 + 0.4 * len(runs)), 0.9 + 2.2 * len(series)), layout="constrained")
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, ((workload, cache), rows) in zip(axes, series.items()):
        x = np.array([order[r["run_id"]] for r in rows])
        delta, low, high = (_column(rows, key) for key in ("delta_points", "ci_low", "ci_high"))
        ax.errorbar(x, delta, yerr=[delta - low, high - delta], fmt="none", ecolor="0.35", elinewidth=1, capsize=3)
        ax.scatter(x, delta, c=[_GATE_COLOURS[r["gate_passed"]][0] for r in rows], s=30, zorder=3)
        trend = trends[(workload, cache)]
        if trend is not None:
            ax.plot(x[[0, -1]], trend[1] + trend[0] * x[[0, -1]], "--", color="tab:blue", linewidth=1)
        ax.plot(x[-1], delta[-1], "*", markersize=15, markerfacecolor="none", markeredgecolor="black", zorder=4)
        ax.axhline(0, color="black", linewidth=0.8)
        low_y, high_y = ax.get_ylim()  # at least ±1 point: a flat series must not read as ±0.04 of precision
        ax.set_ylim(min(low_y, -1.0), max(high_y, 1.0))
        ax.axvline(order[run_id], color="0.85", linewidth=6, zorder=0)
        ax.set_title(f"{workload} · {cache}: trend {_slope(trend)} points/run", fontsize="small")
        ax.set_ylabel("Δ points")
        ax.grid(axis="y", alpha=0.3)
    # Dates, thinned to about twelve labels, and always the current run's; runs without a manifest show their id.
    step = -(-len(runs) // 12)
    ticks = sorted({*range(0, len(runs), step), order[run_id]})
    axes[-1].set_xticks(ticks, [f"{runs[i]['started_at']:%Y-%m-%d %H:%M}" if runs[i]["started_at"] else runs[i]["run_id"]
                                for i in ticks], rotation=30, ha="right", fontsize="x-small")
    axes[-1].set_xlabel("run start (oldest left)")
    handles = [Line2D([], [], marker="o", linestyle="", color=colour, label=label) for colour, label in _GATE_COLOURS.values()]
    handles += [Line2D([], [], marker="*", linestyle="", markersize=12, markerfacecolor="none", markeredgecolor="black",
                       label="this run"), Line2D([], [], linestyle="--", color="tab:blue", label="trend")]
    fig.legend(handles=handles, loc="outside upper center", ncols=len(handles), fontsize="small", frameon=False)
    _save(fig, path)


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
