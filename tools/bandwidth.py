"""The device's copy bandwidth, the ceiling every memory-bound figure is put against (torch and Triton only, so
that the benchmarks that time another checkout's code can import it)."""

from __future__ import annotations

import torch
import triton.testing


def copy_bandwidth(device="cuda") -> float:
    """Bytes/s of a device-to-device copy, bytes read plus bytes written. Timed eagerly: captured in a CUDA graph
    the same copy ran at 2.71 TB/s against 4.25 eagerly (H200, 2026-11-29); at 1 GiB the host's launch overhead
    is negligible."""
    src = torch.randn(2**29, device=device, dtype=torch.float16)  # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
