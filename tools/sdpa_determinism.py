"""Does the fp16 greedy path reproduce itself? The same NIAH requests decoded twice, cuDNN's SDPA on and off.

PyTorch 2.11 sends masked fp16 SDPA on Hopper to cuDNN's fused attention, which did not reproduce its own
outputs on an H200 (BENCHMARKS.md "Multi-GPU"); the worker therefore turns it off. Re-check after a torch or
driver upgrade (GPU):

    python -m tools.sdpa_determinism            # random-weight Llama-2-7B, SmolLM2's tokenizer
"""

from __future__ import annotations

import argparse

import torch

from pipeline.engine import Engine
from pipeline.models import load_model, load_tokenizer
from pipeline.workloads import Request, get_workload, resolve_data_dir


def agreement(engine: Engine, requests: list[Request], batch_size: int = 4) -> int:
    """Requests whose fp16 greedy output is the same in two passes, one after the other in this process."""
    first, second = ([g.text for g in engine.generate(requests, None, batch_size)] for _ in range(2))
    return sum(a == b for a, b in zip(first, second))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-2-7b")
    parser.add_argument("--tokenizer", default="smollm2-135m", help="for random:<shape> models")
    parser.add_argument("--data-dir", help="local data copies (default: $KIVI_DATA_DIR, else ../shared/data beside the "
                                           "checkout where it exists, else the Hub)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[3072, 4096])
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, device)  # fp16 on the GPU
    engine = Engine(model, tokenizer or load_tokenizer(args.tokenizer))
    niah = get_workload("niah", data_dir=resolve_data_dir(args.data_dir), lengths=args.lengths)
    requests = niah.requests(engine.tokenizer, max(args.lengths))
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        print(f"cuDNN SDPA {'on ' if cudnn else 'off'}: {agreement(engine, requests)}/{len(requests)} requests "
              "decoded the same twice", flush=True)


if __name__ == "__main__":
    main()
