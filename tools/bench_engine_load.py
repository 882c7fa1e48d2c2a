"""The decode engine on a nightly-like load: ``python -m tools.bench_engine_load [--baseline-tree PATH]``.

The load (seeded; every count and distribution a parameter): ``--prompts`` requests whose prompts are random
token ids of uniform length in ``--prompt-min..--prompt-max`` and whose ``max_new_tokens`` are drawn log-normal
around ``--new-median`` (as GSM8K answers are), no end ids, on a random-weight model of ``--shape`` (default the
nightly model's, Qwen2.5-1.5B: 28 layers, hidden 1536, 12 / 2 heads, vocab 151,936) in fp16. Each cache
(``--caches``) runs it at each slot count (``--slots``); per run: wall time, prefill and decode time, decode
steps and step time, and prefill tokens/s inside the schedule. Beside them the bare forward's rate (the
decoder's forward on ``--bare`` prompts of 1,000 tokens, no cache, no mask) and the load's bound
``prompt tokens / bare rate + steps x step time``: the prefill at the model's own speed plus the decode steps the
run took, one after the other.

``--baseline-tree PATH`` also runs the engine of another checkout (``git archive REV | tar -x -C PATH``) on the
same load in the same run. ``--variant NAME=KEY:VALUE,...`` adds runs of this tree's engine with other
``DecodeEngine`` arguments (``refill:0.125``, ``prefill_tokens:16384``), on the first ``--variant-prompts``
prompts at the first slot count, fp16.
On the CPU: ``--shape tiny`` (a 2-layer model) and a few prompts (the test does this).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from tools.trees import REPO, git_sha, import_from, run_in_tree, without_options

SHAPES = {
    "qwen2.5-1.5b": Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny": LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512),
}
CACHES = {"fp16": None, "kivi-2": {}}  # KiviConfig fields
MODULE = "tools.bench_engine_load"


def make_load(args) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    vocab = SHAPES[args.shape].vocab_size
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.prompts,), generator=gen)
    new = torch.exp(math.log(args.new_median) + args.new_sigma * torch.randn(args.prompts, generator=gen))
    new = new.round().clamp(args.new_min, args.new_max).long()
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    return {"prompts": prompts, "new": new.tolist()}


def bare_rate(model, prompts: int, tokens: int = 1000, repeats: int = 5) -> float:
    """Tokens/s of the decoder's forward on ``prompts`` x ``tokens`` random ids (no cache, no mask)."""
    ids = torch.randint(3, model.config.vocab_size, (prompts, tokens), device=model.device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            _sync(model.device)
            began = time.perf_counter()
            model.get_decoder()(input_ids=ids, use_cache=False)
            _sync(model.device)
            times.append(time.perf_counter() - began)
    return prompts * tokens / statistics.median(times[1:])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(tree: Path, args, load: dict) -> dict:
    """Every run of the load on the engine of ``tree`` (in this process: call it before anything imports it)."""
    engine_mod = import_from(tree, "pipeline.decode_engine")
    kivi_mod = import_from(tree, "kivi")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(SHAPES[args.shape], dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    sequences = [engine_mod.Sequence(p, n) for p, n in zip(load["prompts"], load["new"])]
    rows = []

    def run(label: str, cache: str, slots: int, todo: list, **kwargs) -> None:
        kivi = None if CACHES[cache] is None else kivi_mod.KiviConfig(**CACHES[cache])
        engine = engine_mod.DecodeEngine(model, **kwargs)
        # Untimed, at the run's batch size and capacity: compiles the step, builds the kernels for them.
        capacity = max(len(s.prompt) + s.max_new_tokens - 1 for s in todo)
        longest = (todo[0].prompt * (capacity // len(todo[0].prompt) + 1))[: capacity - 1]
        warm = [engine_mod.Sequence(longest, 2)] + [engine_mod.Sequence(s.prompt[:64], 2) for s in todo[1:slots]]
        engine.generate(warm, kivi, slots=slots)
        began = time.perf_counter()
        result = engine.generate(todo, kivi, slots=slots)
        wall = time.perf_counter() - began
        prompt_tokens = sum(len(s.prompt) for s in todo)
        rows.append(dict(label=label, cache=cache, slots=slots, requests=len(todo), prompt_tokens=prompt_tokens,
                         new_tokens=sum(len(c.tokens) for c in result.completions), wall_s=wall,
                         prefill_s=result.prefill_s, decode_s=result.decode_s, capture_s=result.capture_s,
                         steps=result.steps, step_ms=1e3 * result.step_s, prefill_tokens_per_s=prompt_tokens / result.prefill_s,
                         peak_mem_bytes=result.peak_mem_bytes, kwargs={k: str(v) for k, v in kwargs.items()}))
        print(_line(rows[-1]), flush=True)

    for cache in args.caches:
        for slots in args.slots:
            run("engine", cache, slots, sequences)
    for variant in args.variant:
        name, _, spec = variant.partition("=")
        kwargs = dict(_argument(*item.split(":", 1)) for item in spec.split(",") if item)
        run(name, "fp16", args.slots[0], sequences[: args.variant_prompts], **kwargs)
    return {"rows": rows, "bare_tokens_per_s": bare_rate(model, args.bare)}


def _argument(key: str, value: str):
    return key, float(value) if "." in value else int(value)


def _line(r: dict) -> str:
    return (f"{r['label']:>10} {r['cache']:>7} slots {r['slots']:4d}: wall {r['wall_s']:7.1f} s, prefill {r['prefill_s']:6.1f} s "
            f"({r['prefill_tokens_per_s'] / 1e3:6.1f}K tok/s), decode {r['decode_s']:6.1f} s, {r['steps']} steps of "
            f"{r['step_ms']:.2f} ms, capture {r['capture_s']:.2f} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--prompts", type=int, default=1319)
    parser.add_argument("--prompt-min", type=int, default=500)
    parser.add_argument("--prompt-max", type=int, default=1200)
    parser.add_argument("--new-median", type=float, default=130)
    parser.add_argument("--new-sigma", type=float, default=0.4)
    parser.add_argument("--new-min", type=int, default=16)
    parser.add_argument("--new-max", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--caches", nargs="+", choices=list(CACHES), default=list(CACHES))
    parser.add_argument("--slots", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--bare", type=int, default=4, help="prompts of 1,000 tokens in the bare forward")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=KEY:VALUE,...")
    parser.add_argument("--variant-prompts", type=int, default=400)
    parser.add_argument("--baseline-tree", type=Path, help="another checkout whose engine runs the same load")
    parser.add_argument("--baseline-slots", type=int, nargs="+", help="the baseline's slot counts (default --slots)")
    parser.add_argument("--in-tree", type=Path, help=argparse.SUPPRESS)  # a child process: measure this tree
    parser.add_argument("--json", default="bench_engine_load.json")
    args = parser.parse_args(argv)
    load = make_load(args)
    if args.in_tree:
        Path(args.json).write_text(json.dumps(measure(args.in_tree, args, load)))
        return
    child_args = without_options(sys.argv[1:] if argv is None else argv, ("--baseline-tree", "--baseline-slots", "--json"))
    runs = {"new": run_in_tree(MODULE, REPO, child_args)}
    if args.baseline_tree:
        base = without_options(child_args, ("--variant", "--slots")) + ["--slots", *map(str, args.baseline_slots or args.slots)]
        runs["baseline"] = run_in_tree(MODULE, args.baseline_tree.resolve(), base)
    meta = {"date": datetime.date.today().isoformat(), "git": git_sha(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "shape": args.shape,
            "load": {k: v for k, v in vars(args).items() if k not in ("baseline_tree", "in_tree", "json")},
            "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None}
    Path(args.json).write_text(json.dumps({**meta, "runs": runs}, indent=1))
    print(f"\n{meta['device']}, {args.shape}: {args.prompts} prompts, {sum(len(p) for p in load['prompts'])} prompt tokens, "
          f"{sum(load['new'])} new tokens")
    print(f"{'tree':>8} {'label':>10} {'cache':>7} {'slots':>5} {'wall s':>7} {'prefill s':>9} {'decode s':>8} {'step ms':>7} "
          f"{'prefill tok/s':>13} {'bare tok/s':>10} {'bound s':>7} {'wall/bound':>10} {'prefill/bare':>12}")
    for tree, result in runs.items():
        bare = result["bare_tokens_per_s"]
        for r in result["rows"]:
            bound = r["prompt_tokens"] / bare + r["decode_s"]
            print(f"{tree:>8} {r['label']:>10} {r['cache']:>7} {r['slots']:5d} {r['wall_s']:7.1f} {r['prefill_s']:9.1f} "
                  f"{r['decode_s']:8.1f} {r['step_ms']:7.2f} {r['prefill_tokens_per_s']:13.0f} {bare:10.0f} {bound:7.1f} "
                  f"{r['wall_s'] / bound:10.2f} {r['prefill_tokens_per_s'] / bare:12.2f}")


if __name__ == "__main__":
    main()
