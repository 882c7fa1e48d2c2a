"""What rounding a decode kernel may afford: ``python -m tools.decode_precision [--json PATH]`` (CPU, seconds).

The relative error against float64 attention over the same quantized cache (KIVI-2, G = 32, R = 128) when one
operand is rounded to fp16 the way a tensor-core kernel would hold it:
- ``keys fp16``: keys dequantized (code * s + z) and rounded to fp16;
- ``q*s fp16``: keys as exact codes, q * s (per channel) rounded to one fp16 part, the zero term exact;
- ``q*s hi/lo``: q * s as two fp16 parts, hi + lo (what the CUDA kernel does);
- ``values fp16``: values dequantized and rounded to fp16;
- ``p fp16``: the probabilities rounded to fp16 before they weight the values;
- ``p*s fp16``: values as exact codes against p * s (per token) rounded to fp16, p * z exact, p an fp16 holding
  2^bits times the probability, bits as large as keeps p * s of the largest scale below 2^15, at most 15 (what the
  CUDA kernel does); ``p*s fp16 x1``: the same with bits = 0, where p * s of small value scales falls among fp16's
  subnormals.
On random K/V with outlier channels (``tools.kernel_data.outlier_kv``), the same with values 1e-4 as large, and the
real SmolLM2 K/V of the tests.
"""

from __future__ import annotations

import argparse
import json

import torch

from kivi.quant import GROUP_DIM, quantize, unpack
from tools.kernel_data import REAL_KV, outlier_kv, relative_error
from tools.trees import git_sha

GROUP, RESIDUAL = 32, 128


def probability_bits(scales: torch.Tensor) -> int:
    """The CUDA kernel's factor 2^bits on the probabilities: the largest scale is below 2^(e - 14), e its biased
    fp16 exponent, so p * s < 2^(bits + e - 14) <= 2^15."""
    exponent = int(scales.half().view(torch.int16).max()) >> 10
    return min(15, 29 - exponent)


def variant_errors(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bits: int = 2) -> dict[str, float]:
    """query [B, Hq, D], keys / values [B, Hkv, T, D]: relative error of each rounding (the module's list)."""
    batch, kv_heads, tokens, dim = keys.shape
    n = (tokens - 1) // RESIDUAL * RESIDUAL  # quantized tokens; the newest stay full precision
    kq = quantize(keys[:, :, :n], bits, GROUP, GROUP_DIM["channel"])
    vq = quantize(values[:, :, :n], bits, GROUP, GROUP_DIM["token"])
    kc = unpack(kq.codes, bits, GROUP_DIM["channel"]).double()
    ks, kz = (t.double().repeat_interleave(GROUP, 2) for t in (kq.scale, kq.zero))
    vc = unpack(vq.codes, bits, GROUP_DIM["token"]).double()
    vs, vz = (t.double().repeat_interleave(GROUP, 3) for t in (vq.scale, vq.zero))
    k_full = torch.cat([kc * ks + kz, keys[:, :, n:].double()], 2)
    v_full = torch.cat([vc * vs + vz, values[:, :, n:].double()], 2)
    q = query.double().view(batch, kv_heads, -1, dim)
    scale = dim**-0.5

    def logits(q_times_s: torch.Tensor | None = None, k: torch.Tensor = k_full) -> torch.Tensor:
        if q_times_s is None:
            return torch.einsum("bhgd,bhtd->bhgt", q, k) * scale
        quantized = (q_times_s * kc.unsqueeze(2)).sum(-1) + torch.einsum("bhgd,bhtd->bhgt", q, kz)
        return torch.cat([quantized, torch.einsum("bhgd,bhtd->bhgt", q, keys[:, :, n:].double())], -1) * scale

    def unnormalized(s: torch.Tensor) -> torch.Tensor:
        return torch.exp(s - s.amax(-1, keepdim=True))

    def attend(s: torch.Tensor, v: torch.Tensor = v_full, p16: bool = False) -> torch.Tensor:
        p = unnormalized(s)
        return torch.einsum("bhgt,bhtd->bhgd", p.half().double() if p16 else p, v) / p.sum(-1, keepdim=True)

    def attend_codes(s: torch.Tensor, factor: float) -> torch.Tensor:
        p = unnormalized(s) * factor
        p16 = p.half().double()
        ps = (p16[..., :n].unsqueeze(-1) * vs.unsqueeze(2)).half().double()  # [B, Hkv, g, n, D]
        out = (ps * vc.unsqueeze(2)).sum(3) + torch.einsum("bhgt,bhtd->bhgd", p16[..., :n], vz)
        return (out + torch.einsum("bhgt,bhtd->bhgd", p16[..., n:], values[:, :, n:].double())) / p.sum(-1, keepdim=True)

    exact = logits()
    ref = attend(exact)
    qs = q.unsqueeze(3) * ks.unsqueeze(2)  # [B, Hkv, g, n, D]
    hi = qs.half().double()
    return {
        "keys fp16": relative_error(attend(logits(k=k_full.half().double())), ref),
        "q*s fp16": relative_error(attend(logits(hi)), ref),
        "q*s hi/lo": relative_error(attend(logits(hi + (qs - hi).half().double())), ref),
        "values fp16": relative_error(attend(exact, v_full.half().double()), ref),
        "p fp16": relative_error(attend(exact, p16=True), ref),
        "p*s fp16": relative_error(attend_codes(exact, 2.0**probability_bits(vq.scale)), ref),
        "p*s fp16 x1": relative_error(attend_codes(exact, 1.0), ref),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens, value_scale in ((1024, 1.0), (4096, 1.0), (16384, 1.0), (4096, 1e-4)):
        keys, values = outlier_kv(2, 4, tokens, 128, torch.float16, "cpu", gen)
        query = torch.randn(2, 16, 128, generator=gen).half()
        scaled = f", values x {value_scale:g}" if value_scale != 1 else ""
        rows.append({"data": f"random, outlier keys, GQA 16/4x128, S={tokens}{scaled}",
                     **variant_errors(query, keys, (values.float() * value_scale).half())})
    real = torch.load(REAL_KV)
    rows.append({"data": f"SmolLM2-135M layers {real['layers']}, S={real['keys'].shape[2]}",
                 **variant_errors(real["queries"][:, :, -1].half(), real["keys"].half(), real["values"].half())})
    names = [k for k in rows[0] if k != "data"]
    print(f"{'data':64} " + " ".join(f"{n:>12}" for n in names))
    for r in rows:
        print(f"{r['data']:64} " + " ".join(f"{r[n]:12.2e}" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"git": git_sha(), "bits": 2, "group_size": GROUP, "residual_length": RESIDUAL, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
