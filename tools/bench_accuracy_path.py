"""The accuracy path on the GPU: GSM8K prompts through the decode engine against transformers.generate, same run.

    python -m tools.bench_accuracy_path --data-dir DATA --json benchmarks/DATE-accuracy-path.json

1. ``check``: greedy tokens of the engine (CUDA graph, Triton kernels, slots refilled, long prompts chunked)
   against ``model.generate`` one prompt at a time (fp16: DynamicCache; KIVI: KiviCache on the PyTorch
   oracle), on a small random model with peaky logits, or with ``--check-model`` on a real model's GSM8K
   prompts; where they first differ, the gap between generate's two best logits there says whether it was a tie.
2. ``speed``: ``--n`` GSM8K prompts (lm-eval's 8-shot prompt) on ``--model``, every request decoding ``--new``
   tokens on both paths (EOS and stop strings off, so both do the same work): the pipeline's engine with
   ``--slots`` slots, and today's generate path (``Engine`` falling back to ``transformers.generate``, batches
   of ``--generate-batch``), timed on its first ``--generate-prompts`` prompts and scaled to ``--n`` (every batch
   has the same shape, and the whole set would take most of an hour under KIVI). Wall times include the
   prefill. Beside them, the throughput sweep's point at the engine's batch (``Engine.throughput``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kivi import KiviCache, KiviConfig, enable_kivi
from pipeline.decode_engine import DecodeEngine, Sequence
from pipeline.engine import Engine
from pipeline.models import load_model
from pipeline.names import FP16
from pipeline.workloads import get_workload, prompt_tokens
from tools.trees import git_sha

CACHES = {FP16: None, "kivi2": KiviConfig()}


def peaky_random_check(device: str = "cuda") -> tuple:
    """A small random model with peaky logits (few ties) and 12 random prompts of 40-900 tokens."""
    config = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device, torch.float16).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(40, 900, (12,), generator=gen).tolist()
    news = torch.randint(30, 160, (12,), generator=gen).tolist()
    return model, [torch.randint(1, 2048, (n,), generator=gen).tolist() for n in lengths], news


def real_model_check(spec: str, data_dir: Path, n: int, new: int, device: str = "cuda") -> tuple:
    """A real model (in its own dtype) on its first ``n`` GSM8K prompts as the pipeline renders them."""
    model, tokenizer = load_model(spec, device)
    requests = get_workload("gsm8k", data_dir=data_dir, n=n).requests(tokenizer, 4096)
    return model, Engine(model, tokenizer).prompt_ids(requests), [new] * len(requests)


def check(model, prompts: list[list[int]], news: list[int], slots: int = 4) -> list[dict]:
    """Every prompt decodes its ``news`` tokens (EOS off) on the engine and on generate alone."""
    model.generation_config.eos_token_id = None
    device = model.device
    engine = DecodeEngine(model, prefill_tokens=512, sync_every=8)
    rows = []
    for name, kivi in ((FP16, None), ("kivi-2", KiviConfig()), ("kivi-2-r32", KiviConfig(residual_length=32))):
        run = engine.generate([Sequence(p, n) for p, n in zip(prompts, news)], kivi, slots=slots)
        enable_kivi(model)
        for prompt, new, completion in zip(prompts, news, run.completions):
            ids = torch.tensor([prompt], device=device)
            cache = None if kivi is None else KiviCache(model.config, kivi, use_kernels=False)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                                 max_new_tokens=new, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            want = out.sequences[0, len(prompt):].tolist()
            first = next((i for i, (a, b) in enumerate(zip(completion.tokens, want)) if a != b), None)
            gap = float(out.scores[first][0].float().topk(2).values.diff().abs()) if first is not None else None
            rows.append(dict(cache=name, prompt_tokens=len(prompt), new=new, equal=first is None, first_diff=first,
                             top2_gap=gap))
        equal = sum(r["equal"] for r in rows if r["cache"] == name)
        print(f"check {name}: {equal}/{len(prompts)} equal to generate ({run.admissions} admissions into {run.slots} slots)",
              flush=True)
    return rows


def _timed(fn):
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - began


def speed(args) -> dict:
    model, tokenizer = load_model(args.model, "cuda", torch.float16, tokenizer=args.tokenizer)
    model.generation_config.eos_token_id = None
    workload = get_workload("gsm8k", data_dir=args.data_dir, n=args.n, max_new_tokens=args.new)
    # Every request decodes --new tokens on both paths (generate: no EOS in the model's generation config).
    requests = [dataclasses.replace(r, stop=(), ignore_eos=True)
                for r in workload.requests(tokenizer, 4096)]
    engine = Engine(model, tokenizer)
    tokens = prompt_tokens(tokenizer, [r.prompt for r in requests], [r.chat for r in requests])
    out = {"prompt_tokens_mean": sum(tokens) / len(tokens)}
    for name, kivi in CACHES.items():
        warm = [dataclasses.replace(r, max_new_tokens=4) for r in requests[: args.slots]]
        engine.generate(warm, kivi, args.slots)  # compiles the steps, builds the kernels: not timed
        generations, wall = _timed(lambda: engine.generate(requests, kivi, args.slots))
        decoded = sum(g.output_tokens for g in generations)
        stats = engine.last_run
        subset = requests[: args.generate_prompts]
        fallback, generate_wall = _timed(lambda: engine.generate_with_transformers(subset, kivi, args.generate_batch))
        point = engine.throughput(requests, kivi, args.slots, args.new)
        out[name] = dict(
            engine_wall_s=wall, engine_prefill_s=stats.prefill_s, engine_decode_s=stats.decode_s,
            engine_capture_s=stats.capture_s, engine_steps=stats.steps, engine_output_tokens=decoded,
            engine_decode_tokens_per_s=(decoded - len(requests)) / stats.decode_s, engine_peak_GiB=stats.peak_mem_bytes / 2**30,
            generate_prompts=len(subset), generate_wall_s=generate_wall,
            generate_output_tokens=sum(g.output_tokens for g in fallback),
            generate_wall_scaled_s=generate_wall * len(requests) / len(subset),
            sweep_decode_tokens_per_s=point["decode_tokens_per_s"], sweep_step_ms=point["step_ms"],
        )
        out[f"speedup_{name}"] = out[name]["generate_wall_scaled_s"] / wall
        out[f"sweep_over_engine_decode_{name}"] = point["decode_tokens_per_s"] / out[name]["engine_decode_tokens_per_s"]
        print(f"{name}: engine {wall:.1f} s for {len(requests)} requests ({decoded} tokens), generate {generate_wall:.1f} s "
              f"for {len(subset)} -> {out[name]['generate_wall_scaled_s']:.0f} s scaled: {out[f'speedup_{name}']:.1f}x; "
              f"decode tokens/s engine {out[name]['engine_decode_tokens_per_s']:.0f} vs sweep point "
              f"{point['decode_tokens_per_s']:.0f}", flush=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--model", default="random:llama-2-7b")
    parser.add_argument("--tokenizer", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--generate-batch", type=int, default=16)
    parser.add_argument("--generate-prompts", type=int, default=32)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--check-model", help="run the check on this real model's GSM8K prompts (default: a peaky random model)")
    parser.add_argument("--check-prompts", type=int, default=8)
    parser.add_argument("--check-new", type=int, default=96)
    parser.add_argument("--check-only", action="store_true", help="the check alone: no speed runs")
    parser.add_argument("--json", type=Path, default=Path("accuracy-path.json"))
    args = parser.parse_args(argv)
    meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), git=git_sha(),
                torch=torch.__version__, model=args.model, n=args.n, new=args.new, slots=args.slots,
                generate_batch=args.generate_batch, generate_prompts=args.generate_prompts)
    if args.skip_check:
        rows = []
    elif args.check_model:
        meta["check_model"] = args.check_model
        rows = check(*real_model_check(args.check_model, args.data_dir, args.check_prompts, args.check_new))
    else:
        rows = check(*peaky_random_check())
    result = {**meta, "check": rows, **({} if args.check_only else speed(args))}
    args.json.write_text(json.dumps(result, indent=1))
    _print_check(rows)
    if args.check_only:
        return
    print(f"{'cache':6} {'engine s':>9} {'generate s (scaled)':>20} {'speed-up':>9} {'engine dec tok/s':>17} {'sweep dec tok/s':>16}")
    for name in CACHES:
        r = result[name]
        print(f"{name:6} {r['engine_wall_s']:9.1f} {r['generate_wall_scaled_s']:20.1f} {result[f'speedup_{name}']:9.1f} "
              f"{r['engine_decode_tokens_per_s']:17.0f} {r['sweep_decode_tokens_per_s']:16.0f}")


def _print_check(rows: list[dict]) -> None:
    for name in (FP16, "kivi-2", "kivi-2-r32"):
        mine = [r for r in rows if r["cache"] == name]
        if mine:
            print(f"check {name}: {sum(r['equal'] for r in mine)}/{len(mine)} equal; first diffs (top-2 gap): "
                  + ", ".join(f"{r['first_diff']} ({r['top2_gap']:.3f})" for r in mine if not r["equal"]))


if __name__ == "__main__":
    main()
