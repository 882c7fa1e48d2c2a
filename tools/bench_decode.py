"""Decode-step benchmark of the engine: ``python -m tools.bench_decode [--baseline-tree PATH] [--generate]``.

One model (default a random-weight Llama-2-7B in fp16), the same prompts (random token ids) and ``--new``
greedy tokens with EOS ignored, at each ``--batch``:

- ``engine fp16`` / ``engine kivi-2``: DecodeEngine, the step time of its decode loop (CUDA-graph replays);
- with ``--baseline-tree PATH``: the same of another checkout's engine (``git archive REV | tar -x -C PATH``),
  in a child process of the same run, on the same model and prompts;
- with ``--generate``: ``model.generate`` with its DynamicCache (``hf dynamic``) and with
  ``cache_implementation="static"``, whose decode step transformers compiles (``hf static``; a first call per
  batch size compiles and is not timed). A generate step = (time for ``new`` tokens - time for 1 token) /
  (new - 1): prefill and the first token cancel;
- ``floor``: the weights' bytes / a device-to-device copy's bandwidth measured in the same run.

``--check-model SPEC --text FILE``: greedy tokens of the engine (fp16 cache, prompts batched, ragged) against
``model.generate`` one prompt at a time, for a real model; where they first differ, the gap between
generate's two best logits shows whether it was a tie.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import triton
from transformers import AutoModelForCausalLM, LlamaConfig

from tools.bandwidth import copy_bandwidth
from tools.trees import REPO, git_sha, import_from, run_in_tree, without_options

MODULE = "tools.bench_decode"
SHAPES = {"llama-2-7b": LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                    max_position_embeddings=4096, rms_norm_eps=1e-5),
          "tiny": LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=512)}


def random_model(shape: str, device: torch.device):
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(SHAPES[shape], dtype=torch.float16 if device.type == "cuda" else torch.float32)
    model.generation_config.eos_token_id = None  # generate must decode all `new` tokens, as the engine does
    return model.eval()


def prompt_ids(batch: int, prompt: int, vocab: int) -> list[list[int]]:
    return torch.randint(vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch)).tolist()


def measure(tree: Path, args) -> dict:
    """Engine step times of ``tree`` at every batch (in this process: before anything imports its packages)."""
    engine_mod = import_from(tree, "pipeline.decode_engine")
    kivi_mod = import_from(tree, "kivi")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = random_model(args.shape, device)
    engine = engine_mod.DecodeEngine(model)
    rows = []
    for batch in args.batch:
        row = {"batch": batch, "prompt": args.prompt, "new": args.new}
        for name, kivi in (("engine_fp16", None), ("engine_kivi2", kivi_mod.KiviConfig())):
            run = engine.run(prompt_ids(batch, args.prompt, model.config.vocab_size), args.new, kivi)
            row[f"{name}_ms"], row[f"{name}_capture_s"] = 1e3 * run.step_s, run.capture_s
            row[f"{name}_peak_GiB"] = run.peak_mem_bytes / 2**30 if run.peak_mem_bytes else None
            print(f"{tree.name} B={batch} {name}: {1e3 * run.step_s:.2f} ms/step (prefill {run.prefill_s:.2f} s, "
                  f"capture {run.capture_s:.2f} s)", flush=True)
        if args.generate:
            ids = torch.tensor(prompt_ids(batch, args.prompt, model.config.vocab_size), device=device)
            row["hf_dynamic_ms"] = generate_step_ms(model, ids, args.new)
            row["hf_static_ms"] = generate_step_ms(model, ids, args.new, warm=True, cache_implementation="static")
            print(f"B={batch} hf dynamic {row['hf_dynamic_ms']:.2f} ms, static (compiled) {row['hf_static_ms']:.2f} ms",
                  flush=True)
        rows.append(row)
    weight_bytes = sum(p.nbytes for p in model.parameters())
    copy = copy_bandwidth(device) if device.type == "cuda" else None
    return {"rows": rows, "weight_GB": weight_bytes / 1e9, "copy_GBps": copy and copy / 1e9,
            "floor_ms": copy and 1e3 * weight_bytes / copy}


def _generate_s(model, ids: torch.Tensor, new: int, **kwargs) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, pad_token_id=0, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - began


def generate_step_ms(model, ids: torch.Tensor, new: int, warm: bool = False, **kwargs) -> float:
    if warm:  # compile and autotune on this batch size first
        _generate_s(model, ids, new, **kwargs)
    full = _generate_s(model, ids, new, **kwargs)
    first = _generate_s(model, ids, 1, **kwargs)
    return 1e3 * (full - first) / (new - 1)


def check_tokens(spec: str, text: str, new: int) -> list[dict]:
    # This tree's engine, imported here: the module's own imports stay clear of the packages a child process
    # imports from the tree it measures.
    from pipeline.decode_engine import DecodeEngine
    from pipeline.models import load_model

    model, tokenizer = load_model(spec, device="cuda", dtype=torch.float16)
    model.generation_config.eos_token_id = None  # the engine ignores EOS; so must generate
    text_ids = tokenizer(text, add_special_tokens=False).input_ids
    prompts = [text_ids[:n] for n in (100, 250, 400, 550)]
    tokens = DecodeEngine(model).run(prompts, new, None).tokens
    rows = []
    for prompt, got in zip(prompts, tokens):
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        want = out.sequences[0, len(prompt):].cpu()
        diff = (got != want).nonzero()
        first = int(diff[0]) if len(diff) else None
        gap = float(out.scores[first][0].float().topk(2).values.diff().abs()) if first is not None else None
        rows.append({"prompt_tokens": len(prompt), "equal": first is None, "first_diff": first, "top2_gap": gap})
        print(f"prompt {len(prompt)} tokens: {'equal' if first is None else f'first diff at {first}, top-2 gap {gap:.4f}'}", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-2-7b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--generate", action="store_true", help="also time transformers.generate (dynamic, static)")
    parser.add_argument("--baseline-tree", type=Path, help="another checkout whose engine runs the same steps")
    parser.add_argument("--check-model", help="a real model for the token comparison (skipped without it)")
    parser.add_argument("--text", help="a long text whose beginnings are the comparison's prompts")
    parser.add_argument("--in-tree", type=Path, help=argparse.SUPPRESS)  # a child process: measure this tree
    parser.add_argument("--json", default="bench_decode.json")
    args = parser.parse_args(argv)
    if args.in_tree:
        Path(args.json).write_text(json.dumps(measure(args.in_tree, args)))
        return
    child = without_options(sys.argv[1:] if argv is None else argv, ("--baseline-tree", "--check-model", "--text", "--json"))
    runs = {"new": run_in_tree(MODULE, REPO, child)}
    if args.baseline_tree:
        runs["baseline"] = run_in_tree(MODULE, args.baseline_tree.resolve(), without_options(child, ("--generate",)))
    tokens = check_tokens(args.check_model, Path(args.text).read_text(), 64) if args.check_model else []
    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": datetime.date.today().isoformat(), "git": git_sha(), "torch": torch.__version__,
            "triton": triton.__version__, "shape": args.shape, "baseline_tree": args.baseline_tree and str(args.baseline_tree)}
    Path(args.json).write_text(json.dumps({**meta, "runs": runs, "tokens": tokens}, indent=1))
    new = runs["new"]
    if new["floor_ms"]:
        print(f"{meta['device']}: copy {new['copy_GBps'] / 1e3:.2f} TB/s, weights {new['weight_GB']:.2f} GB -> floor "
              f"{new['floor_ms']:.2f} ms/step")
    base = {r["batch"]: r for r in runs.get("baseline", {}).get("rows", [])}
    print(f"{'B':>3} {'fp16 new':>8} {'fp16 base':>9} {'new/base':>8} {'kivi2 new':>9} {'kivi2 base':>10} {'new/base':>8} "
          f"{'hf dynamic':>10} {'hf static':>9}")
    for r in new["rows"]:
        b = base.get(r["batch"], {})
        ratio = lambda k: f"{r[k] / b[k]:8.3f}" if k in b else f"{'':>8}"
        print(f"{r['batch']:3d} {r['engine_fp16_ms']:8.2f} {b.get('engine_fp16_ms', float('nan')):9.2f} {ratio('engine_fp16_ms')} "
              f"{r['engine_kivi2_ms']:9.2f} {b.get('engine_kivi2_ms', float('nan')):10.2f} {ratio('engine_kivi2_ms')} "
              f"{r.get('hf_dynamic_ms', float('nan')):10.2f} {r.get('hf_static_ms', float('nan')):9.2f}")
    if tokens:
        print(f"greedy tokens, engine vs generate, 64 tokens: {sum(t['equal'] for t in tokens)}/{len(tokens)} prompts equal")


if __name__ == "__main__":
    main()
