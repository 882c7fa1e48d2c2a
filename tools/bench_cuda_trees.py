"""The CUDA decode kernel of several checkouts in one run: ``python -m tools.bench_cuda_trees [--baseline-tree PATH ...]``.

A kernel change measured against the kernels it replaces, on the same GPU in the same run: this checkout and each
``--baseline-tree`` (``git archive REV | tar -x -C PATH``) in a child process of its own (``tools.trees``), which
imports that tree's ``kivi`` and times it with this checkout's ``tools.kernel_bench`` (same inputs, seeded; the
same CUDA-graph medians over rotated inputs): fp16 SDPA and the CUDA KIVI-2 kernel at the tree's default split
count and a few others, at the sizes issue 34 targets (``CASES``). Prints SDPA / CUDA per tree and case.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import torch

from tools.trees import REPO, git_sha, import_from, run_in_tree, without_options

MODULE = "tools.bench_cuda_trees"
# (shape of tools.kernel_bench.SHAPES, batch, tokens, split counts timed besides the default)
CASES = (("qwen2.5-1.5b", 64, 1024, (1, 2, 3)), ("qwen2.5-1.5b", 256, 1024, (1, 2)), ("llama2-7b", 512, 640, (1,)),
         ("llama2-7b", 8, 32768, ()), ("gqa-32/8", 8, 32768, ()))


def kernels_of(tree: Path) -> tuple[ModuleType, ModuleType]:
    """(this checkout's tools.kernel_bench, the tree's kivi.kernels.cuda_decode), kernel_bench timing the tree's
    kernels: the tree's kivi is imported first, so kernel_bench's own imports of it resolve there."""
    cuda_decode = import_from(tree, "kivi.kernels.cuda_decode")
    return importlib.import_module("tools.kernel_bench"), cuda_decode


def measure(tree: Path) -> list[dict]:
    bench, cuda_decode = kernels_of(tree)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape, batch, tokens, splits in CASES:
        case = bench.DecodeCase(shape, batch, tokens)
        query, keys, values = bench.decode_inputs(case, gen)
        default = cuda_decode.default_num_splits(batch, case.heads[1], tokens, query.device)
        row = {"shape": shape, "batch": batch, "tokens": tokens, "sdpa_ms": bench.time_sdpa(query, keys, values)[0],
               "default_splits": default,
               "cuda2_ms": {n: bench.time_cuda(query, keys, values, 2, n)[0] for n in sorted({default, *splits})}}
        rows.append(row)
        print(f"  {shape} B={batch} S={tokens}: SDPA {row['sdpa_ms']:.4f} ms, CUDA KIVI-2 " +
              ", ".join(f"{n} splits {ms:.4f}" for n, ms in row["cuda2_ms"].items()), flush=True)
        del query, keys, values
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, action="append", default=[], help="another checkout (repeatable)")
    parser.add_argument("--in-tree", type=Path, help=argparse.SUPPRESS)  # a child process: measure this tree
    parser.add_argument("--json", default="bench_cuda_trees.json")
    args = parser.parse_args(argv)
    if args.in_tree:
        Path(args.json).write_text(json.dumps(measure(args.in_tree)))
        return
    child_args = without_options(sys.argv[1:] if argv is None else argv, ("--baseline-tree", "--json"))
    runs = {str(tree): run_in_tree(MODULE, tree.resolve(), child_args) for tree in args.baseline_tree}
    runs["this"] = run_in_tree(MODULE, REPO, child_args)
    Path(args.json).write_text(json.dumps({"date": datetime.date.today().isoformat(), "git": git_sha(),
                                           "device": torch.cuda.get_device_name(), "runs": runs}, indent=1))
    print(f"\nSDPA / CUDA KIVI-2 at the default split count (best count in brackets), {torch.cuda.get_device_name()}")
    print(f"{'tree':>24} " + " ".join(f"{f'{s} {b}x{t}':>22}" for s, b, t, _ in CASES) + f" {'geomean':>8}")
    for tree, rows in runs.items():
        ratios = [r["sdpa_ms"] / r["cuda2_ms"][str(r["default_splits"])] for r in rows]
        best = [min(r["cuda2_ms"], key=r["cuda2_ms"].get) for r in rows]
        print(f"{tree[-24:]:>24} " + " ".join(f"{f'{x:.2f}x ({n})':>22}" for x, n in zip(ratios, best)) +
              f" {math.exp(sum(map(math.log, ratios)) / len(ratios)):8.3f}")


if __name__ == "__main__":
    main()
