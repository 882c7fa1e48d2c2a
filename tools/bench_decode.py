"""Decode-step benchmark of the static engine against transformers.generate: ``python -m tools.bench_decode``.

One run, one model (default a random-weight Llama-2-7B in fp16), the same prompts (random token ids) and
``--new`` greedy tokens with EOS ignored, at each ``--batch``:

- ``engine fp16`` / ``engine kivi-2``: DecodeEngine, the step time of its decode loop;
- ``hf dynamic``: ``model.generate`` with its DynamicCache;
- ``hf static``: ``model.generate(cache_implementation="static")``, whose decode step transformers compiles
  (a first call per batch size compiles and is not timed);
- ``floor``: the weights' bytes / a device-to-device copy's bandwidth measured in the same run.

A generate step = (time for ``new`` tokens - time for 1 token) / (new - 1): prefill and the first token cancel.
``--check-model SPEC --text FILE``: greedy tokens of the engine (fp16 cache, prompts batched, ragged) against
``model.generate`` one prompt at a time, for a real model; where they first differ, the gap between
generate's two best logits shows whether it was a tie.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
import triton

from kivi import KiviConfig
from pipeline.decode_engine import DecodeEngine
from pipeline.models import load_model
from tools.kernel_bench import copy_bandwidth, git_sha


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


def speed(model, batches: list[int], prompt: int, new: int) -> list[dict]:
    model.generation_config.eos_token_id = None  # generate must decode all `new` tokens, as the engine does
    engine = DecodeEngine(model)
    vocab = model.config.vocab_size
    rows = []
    for batch in batches:
        ids = torch.randint(vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch)).cuda()
        row = {"batch": batch, "prompt": prompt, "new": new}
        for name, kivi in (("engine_fp16", None), ("engine_kivi2", KiviConfig())):
            run = engine.run(ids.tolist(), new, kivi)
            row[f"{name}_ms"], row[f"{name}_peak_GiB"] = 1e3 * run.step_s, run.peak_mem_bytes / 2**30
            print(f"B={batch} {name}: {1e3 * run.step_s:.2f} ms/step (prefill {run.prefill_s:.2f} s, capture {run.capture_s:.2f} s)",
                  flush=True)
        row["hf_dynamic_ms"] = generate_step_ms(model, ids, new)
        print(f"B={batch} hf dynamic: {row['hf_dynamic_ms']:.2f} ms/step", flush=True)
        row["hf_static_ms"] = generate_step_ms(model, ids, new, warm=True, cache_implementation="static")
        print(f"B={batch} hf static (compiled): {row['hf_static_ms']:.2f} ms/step", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def check_tokens(spec: str, text: str, new: int) -> list[dict]:
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
        gap = None
        if first is not None:
            top = out.scores[first][0].float().topk(2).values
            gap = float(top[0] - top[1])
        rows.append({"prompt_tokens": len(prompt), "equal": first is None, "first_diff": first, "top2_gap": gap})
        print(f"prompt {len(prompt)} tokens: {'equal' if first is None else f'first diff at {first}, top-2 gap {gap:.4f}'}", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-2-7b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--check-model", help="a real model for the token comparison (skipped without it)")
    parser.add_argument("--text", help="a long text whose beginnings are the comparison's prompts")
    parser.add_argument("--json", default="bench_decode.json")
    args = parser.parse_args(argv)
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "git": git_sha(),
            "torch": torch.__version__, "triton": triton.__version__, "model": args.model}
    copy_bw = copy_bandwidth()
    model, _ = load_model(args.model, device="cuda", dtype=torch.float16)
    weight_bytes = sum(p.nbytes for p in model.parameters())
    meta |= {"copy_GBps": copy_bw / 1e9, "weight_GB": weight_bytes / 1e9, "floor_ms": 1e3 * weight_bytes / copy_bw}
    rows = speed(model, args.batch, args.prompt, args.new)
    del model
    torch.cuda.empty_cache()
    tokens = check_tokens(args.check_model, Path(args.text).read_text(), 64) if args.check_model else []
    Path(args.json).write_text(json.dumps({**meta, "speed": rows, "tokens": tokens}, indent=1))
    print(f"{meta['device']}: copy {copy_bw / 1e12:.2f} TB/s, weights {weight_bytes / 1e9:.2f} GB -> floor {meta['floor_ms']:.2f} ms/step")
    print(f"{'B':>3} {'engine fp16':>11} {'engine kivi2':>12} {'hf dynamic':>10} {'hf static':>9} {'fp16/floor':>10} {'hf static/engine':>16}")
    for r in rows:
        print(f"{r['batch']:3d} {r['engine_fp16_ms']:11.2f} {r['engine_kivi2_ms']:12.2f} {r['hf_dynamic_ms']:10.2f} "
              f"{r['hf_static_ms']:9.2f} {r['engine_fp16_ms'] / meta['floor_ms']:10.2f} {r['hf_static_ms'] / r['engine_fp16_ms']:16.2f}")
    if tokens:
        print(f"greedy tokens, engine vs generate, 64 tokens: {sum(t['equal'] for t in tokens)}/{len(tokens)} prompts equal")


if __name__ == "__main__":
    main()
