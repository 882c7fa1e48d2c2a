"""How far a KIVI cache moves a model's next-token distributions: teacher-forced KL to fp16 and perplexity.

    python -m tools.fidelity --model smollm2-135m --tokens 2048 --json

A long real text (the NIAH haystack of Paul Graham essays) is fed in chunks: the first chunk is the prefill,
every later chunk attends to what the cache stored, as decode steps do. For each configuration the mean
KL(p_fp16 || p_kivi) and the perplexity are taken over all positions after the prefill chunk.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from kivi.config import FP16, KiviConfig
from kivi.fidelity import DEFAULT_CONFIGS, measure_fidelity
from pipeline.models import load_model
from pipeline.workloads import resolve_data_dir
from pipeline.workloads.fidelity import haystack_text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=32, help="tokens per forward step after the prefill chunk")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    parser.add_argument("--data-dir", type=Path, help="folder with niah/PaulGrahamEssays (default: $KIVI_DATA_DIR, else "
                                                      "../shared/data beside the checkout where it exists)")
    parser.add_argument("--text-file", type=Path, help="use this text instead of the essays")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    for name in configs:  # fail on a bad name before the model loads
        if name != FP16:
            KiviConfig.from_name(name)
    if args.text_file is None and args.data_dir is None:
        parser.error("pass --data-dir (or set KIVI_DATA_DIR) to the shared data folder, or --text-file")

    text = args.text_file.read_text() if args.text_file else haystack_text(Path(args.data_dir))

    model, tokenizer = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens].to(args.device)
    if ids.shape[1] < args.tokens:
        parser.error(f"--tokens {args.tokens}: the text has only {ids.shape[1]} tokens")
    rows = measure_fidelity(model, ids, configs, args.chunk)
    if args.json:
        print(json.dumps({"model": args.model, "tokens": args.tokens, "chunk": args.chunk, "dtype": args.dtype,
                          "rows": [asdict(r) for r in rows]}, indent=2))
        return
    print(f"{'config':<14} {'cache':<30} {'mean KL':>10} {'top-1':>7} {'ppl':>9} {'kv ratio':>9}")
    for r in rows:
        print(f"{r.config:<14} {r.cache:<30} {r.mean_kl:>10.5f} {r.top1_agreement:>7.3f} {r.perplexity:>9.3f} {r.kv_ratio:>9.3f}")


if __name__ == "__main__":
    main()
