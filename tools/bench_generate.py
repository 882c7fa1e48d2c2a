"""Batch generation against the throughput sweep, in one process: ``python -m tools.bench_generate --n 10000``.

``--n`` ShareGPT first-turn prompts (vLLM's sampling, real prompt lengths: the file's valid pairs in their shuffled
order, repeated when ``--n`` exceeds them), each generating its reply's real length capped at ``--max-new-tokens``,
under fp16 and KIVI-2 on a random-weight Llama-2-7B (ids folded into its vocabulary, EOS never ends a row: the
tokens counted are the tokens produced). Generation runs as ``kivi-eval generate`` runs a shard: the decode engine
with ``--batch`` slots, refilled as rows end, one call per ``--shard-size`` rows, each output decoded to text.
Beside it, in the same process, the throughput sweep's point at that batch (the decode engine's ``run`` on the
first ``--batch`` prompts, every one decoding the batch's longest capped length, as ``Engine.throughput``). Each
cache runs once untimed first (kernel compilation, graph capture). Then ``--sampled`` prompts are generated
sampled (temperature 1, top-p 0.95, a seed per row) twice: the same draws both times, inside the captured step.

Prints a table last; ``--json PATH`` writes every figure. Imports neither Ray, DuckDB, pydantic nor datasets: it
runs on a GPU host that has only torch, transformers, triton and pyarrow.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time
from collections import Counter
from pathlib import Path

import torch

from kivi import KiviConfig
from pipeline.decode_engine import DecodeEngine, DecodeRun, Sequence
from pipeline.models import load_model
from pipeline.names import FP16
from pipeline.sampling import Sampling
from pipeline.sharegpt_pairs import LOCAL_PATTERN, LengthLimits, sample_pairs
from tools.kernel_bench import git_sha

CACHES = {FP16: None, "kivi-2": KiviConfig.from_name("kivi-2")}


def sharegpt_prompts(data_dir: Path, tokenizer, vocab: int, n: int, cap: int, max_context: int) -> tuple[list, int]:
    """``n`` (prompt ids, new tokens) pairs and how many distinct prompts they hold."""
    (path,) = sorted((data_dir / "sharegpt").glob(LOCAL_PATTERN))
    pairs = sample_pairs(json.loads(path.read_text(encoding="utf-8")), tokenizer, n, 0, LengthLimits(), max_context,
                         Counter())
    ids = tokenizer([p.prompt for p in pairs], add_special_tokens=False).input_ids
    distinct = [([t % vocab for t in prompt], min(p.output_len, cap)) for prompt, p in zip(ids, pairs)]
    return list(itertools.islice(itertools.cycle(distinct), n)), len(distinct)


def generation(engine: DecodeEngine, tokenizer, rows: list, kivi, batch: int, shard_size: int) -> dict:
    """The rows through the engine shard by shard, each output decoded: tokens/s over the whole wall time."""
    runs: list[DecodeRun] = []
    _sync()
    began = time.perf_counter()
    for start in range(0, len(rows), shard_size):
        run = engine.generate([Sequence(p, new) for p, new in rows[start : start + shard_size]], kivi, slots=batch)
        [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in run.completions]
        runs.append(run)
    _sync()
    wall = time.perf_counter() - began
    tokens = sum(len(c.tokens) for run in runs for c in run.completions)
    peaks = [run.peak_mem_bytes for run in runs if run.peak_mem_bytes is not None]
    return dict(rows=len(rows), output_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                prefill_s=sum(r.prefill_s for r in runs), decode_s=sum(r.decode_s for r in runs),
                capture_s=sum(r.capture_s for r in runs), steps=sum(r.steps for r in runs),
                admissions=sum(r.admissions for r in runs), peak_mem_bytes=max(peaks) if peaks else None)


def sweep_point(engine: DecodeEngine, rows: list, kivi, batch: int) -> dict:
    """The throughput sweep at ``batch``: its first prompts together, each decoding the longest capped length."""
    prompts, gen_len = [p for p, _ in rows[:batch]], max(new for _, new in rows[:batch])
    run = engine.run(prompts, gen_len, kivi)
    return dict(batch=len(prompts), gen_len=gen_len, prompt_len=max(map(len, prompts)),
                tokens_per_s=len(prompts) * gen_len / (run.prefill_s + run.decode_s),
                decode_tokens_per_s=len(prompts) * (gen_len - 1) / run.decode_s if gen_len > 1 else None,
                step_ms=1e3 * run.step_s, prefill_s=run.prefill_s, peak_mem_bytes=run.peak_mem_bytes)


def sampled_twice(engine: DecodeEngine, rows: list, kivi, batch: int) -> dict:
    """Sampled rows twice, in ``batch`` slots then in half as many: how many came out the same."""
    sequences = [Sequence(p, new, sampling=Sampling(temperature=1.0, top_p=0.95, seed=i)) for i, (p, new) in enumerate(rows)]
    first, second = ([c.tokens for c in engine.generate(sequences, kivi, slots=slots).completions]
                     for slots in (batch, max(batch // 2, 1)))
    return dict(rows=len(rows), identical=sum(a == b for a, b in zip(first, second)))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-2-7b")
    parser.add_argument("--tokenizer", default="smollm2-135m", help="for random:<shape> models")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--n", type=int, default=10000, help="rows to generate per cache")
    parser.add_argument("--batch", type=int, default=128, help="decode slots, and the sweep point's batch")
    parser.add_argument("--shard-size", type=int, default=256, help="rows per engine call (kivi-eval generate's default)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="cap on each row's real output length")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--sampled", type=int, default=64, help="rows of the sampling check (0: none)")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model, tokenizer = load_model(args.model, device,
                                  tokenizer=args.tokenizer if args.model.startswith("random:") else None)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    rows, distinct = sharegpt_prompts(args.data_dir, tokenizer, vocab, args.n, args.max_new_tokens, args.max_context)
    engine = DecodeEngine(model)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "date": datetime.date.today().isoformat(), "git": git_sha(), "torch": torch.__version__,
           "model": args.model, "tokenizer": args.tokenizer, "n": len(rows), "distinct_prompts": distinct,
           "batch": args.batch, "shard_size": args.shard_size, "max_new_tokens": args.max_new_tokens, "caches": {}}
    for name in args.caches:
        kivi = CACHES[name]
        engine.run([p for p, _ in rows[: args.batch]], 2, kivi)  # untimed: compile, autotune, capture
        generated = generation(engine, tokenizer, rows, kivi, args.batch, args.shard_size)
        sweep = sweep_point(engine, rows, kivi, args.batch)
        out["caches"][name] = dict(generation=generated, sweep=sweep,
                                   sweep_over_generation=sweep["tokens_per_s"] / generated["tokens_per_s"])
        if args.sampled:
            out["caches"][name]["sampling_check"] = sampled_twice(engine, rows[: args.sampled], kivi, args.batch)
        print(f"{name}: generation {generated['tokens_per_s']:.1f} tokens/s, sweep {sweep['tokens_per_s']:.1f}", flush=True)
        if args.json:  # after each cache: a run stopped by its time limit keeps what it measured
            args.json.write_text(json.dumps(out, indent=1))
    gib = 2**30
    print(f"{out['device']}, {args.model}: {len(rows)} ShareGPT rows ({distinct} distinct), batch {args.batch}, "
          f"shards of {args.shard_size}, new tokens <= {args.max_new_tokens}")
    print(f"{'cache':>7} {'gen tokens/s':>12} {'sweep tokens/s':>14} {'sweep/gen':>9} {'wall s':>8} {'peak GiB':>8} "
          f"{'sampled same':>12}")
    for name, c in out["caches"].items():
        g, check = c["generation"], c.get("sampling_check")
        peak = "-" if g["peak_mem_bytes"] is None else f"{g['peak_mem_bytes'] / gib:.1f}"
        same = "-" if check is None else f"{check['identical']}/{check['rows']}"
        print(f"{name:>7} {g['tokens_per_s']:12.1f} {c['sweep']['tokens_per_s']:14.1f} {c['sweep_over_generation']:9.2f} "
              f"{g['wall_s']:8.1f} {peak:>8} {same:>12}")
    return out


if __name__ == "__main__":
    main()
