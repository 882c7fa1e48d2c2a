"""What the kernels compile to on an H200, measured on any machine: no GPU needed.

Launches are recorded instead of run (CPU tensors stand in for the GPU's), then compiled for sm_90 exactly as
Triton's launcher would specialize them there; Triton's bundled ptxas and nvdisasm give the registers, the
spilled bytes and the SASS. Instruction counts bound a kernel's speed where bandwidth does not: an H200 issues
at most 4 warp-instructions per clock per multiprocessor.

    python -m tools.sass    # quantize + pack: instructions per element; decode: the fast-tile loop per token

Compiling needs the kernels as JIT functions: run it without TRITON_INTERPRET=1 (recording launches does not).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import kivi.kernels.decode_attention as decode_module
import kivi.kernels.quantize as quantize_module
from kivi import backend
from kivi.config import KiviConfig
from kivi.quant import allocate
from tools.kernel_data import fill_streams

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ON_CUDA = {"GPU": True, "RECIPROCAL": True}  # the constexprs that follow the device, as a CUDA launch sets them


def _jit(kernel) -> JITFunction:
    """The JITFunction behind ``kernel`` (the interpreter wraps the same function)."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)


def _specialize(jit: JITFunction, args: tuple, kwargs: dict):
    """(bound arguments, specialization, options) of a launch, as Triton's launcher computes them on sm_90."""
    return create_function_from_signature(jit.signature, jit.params, BACKEND)(*args, **kwargs)


def compile_key(kernel, *args, **kwargs) -> str:
    """Triton's compile key for a launch with these arguments on sm_90."""
    _, specialization, options = _specialize(_jit(kernel), args, kwargs)
    return f"{specialization} {sorted(options.items())}"


def compile_sm90(kernel, *args, **kwargs):
    """Compile a launch for sm_90, with the device-dependent constexprs (ON_CUDA) as on CUDA."""
    jit = _jit(kernel)
    kwargs = {**kwargs, **{k: v for k, v in ON_CUDA.items() if k in jit.arg_names}}
    bound, specialization, options = _specialize(jit, args, kwargs)
    options, signature, constexprs, attrs = jit._pack_args(BACKEND, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(jit, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


class Launches:
    """Stands in for a kernel (patched over ``module.kernel``): records each launch, runs nothing."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@dataclass
class Sass:
    registers: int  # per thread
    spill_bytes: int  # local memory per thread (0: nothing spilled)
    warps: int
    instructions: list[str]  # opcodes in program order, predicates dropped
    loops: list[list[str]]  # the body of each backward branch, in program order


def disassemble(compiled) -> Sass:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([TOOLS / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        listing = subprocess.run([TOOLS / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
    registers, stack = (int(v) for v in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    opcodes, labels, pending = [], {}, []
    for line in listing.splitlines():
        if label := re.match(r"\s*\.(L_x_\d+):", line):
            pending.append(label.group(1))
        elif ins := re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            opcodes.append(re.sub(r"^@!?U?P\w+\s+", "", ins.group(1)))
            labels.update((name, len(opcodes) - 1) for name in pending)
            pending = []
    loops = []
    for i, ins in enumerate(opcodes):
        target = re.search(r"BRA\S*\s+`\(\.(L_x_\d+)\)", ins)
        if target and labels[target.group(1)] <= i:
            loops.append([op.split()[0] for op in opcodes[labels[target.group(1)] : i + 1]])
    return Sass(registers, stack, compiled.metadata.num_warps, [op.split()[0] for op in opcodes], loops)


def mix(opcodes: list[str]) -> collections.Counter:
    """Opcode counts, modifiers dropped (HMMA.16816.F32 -> HMMA)."""
    return collections.Counter(op.split(".")[0] for op in opcodes)


def quantize_report(bits: int, axis: str) -> tuple[Sass, float]:
    """The launch ``quantize_into`` makes for x fp16 [8, 32, 4096, 128]: its SASS and instructions per element."""
    x = torch.empty(8, 32, 4096, 128, dtype=torch.float16)
    name = "_quantize_channel_kernel" if axis == "channel" else "_quantize_token_kernel"
    with mock.patch.object(quantize_module, name, Launches(getattr(quantize_module, name))) as launches:
        quantize_module.quantize_into(x, allocate(tuple(x.shape), bits, 32, axis, x.dtype, "cpu"), bits, 32, axis)
    args, kwargs = launches.calls[0]
    code = disassemble(compile_sm90(launches.kernel, *args, **kwargs))
    tokens = kwargs["GROUPS"] * 32 if axis == "channel" else kwargs["BLOCK_T"]
    return code, len(code.instructions) * code.warps * 32 / (tokens * x.shape[-1])


def decode_report(q_heads: int, kv_heads: int, bits: int) -> tuple[Sass, list[str], float]:
    """The decode kernel for head_dim 128, G = 32, R = 128 and several splits: its SASS, its fast-tile loop (the
    kernel's first) and that loop's warp-instructions per (token, KV head)."""
    config = KiviConfig(k_bits=bits, v_bits=bits, group_size=32, residual_length=128)
    keys = values = torch.randn(1, kv_heads, 1024, 128).half()
    key_stream, value_stream = fill_streams(keys, values, [1024], config)
    query = torch.randn(1, q_heads, 1, 128).half()
    with (mock.patch.object(decode_module, "_decode_kernel", Launches(decode_module._decode_kernel)) as launches,
          mock.patch.object(decode_module, "merge_splits")):  # nothing to merge: the splits never ran
        backend.decode_attention(query, key_stream, value_stream, 0.088, num_splits=4)
    args, kwargs = launches.calls[0]
    code = disassemble(compile_sm90(launches.kernel, *args, **kwargs))
    return code, code.loops[0], len(code.loops[0]) / decode_module.tile_tokens(bits, 32)


def report() -> list[dict]:
    rows = []
    for bits in (2, 4):
        for axis in ("channel", "token"):
            code, per_element = quantize_report(bits, axis)
            rows.append({"kernel": "quantize", "case": f"{bits}-bit {axis}", "registers": code.registers,
                         "spill_bytes": code.spill_bytes, "per_element": per_element, "mix": mix(code.instructions)})
    for q_heads, kv_heads, bits in ((32, 32, 2), (32, 32, 4), (32, 8, 2)):
        code, fast_tiles, per_token = decode_report(q_heads, kv_heads, bits)
        rows.append({"kernel": "decode", "case": f"{q_heads}/{kv_heads} heads KIVI-{bits}", "registers": code.registers,
                     "spill_bytes": code.spill_bytes, "per_token": per_token, "mix": mix(fast_tiles)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("tools.sass compiles for the GPU: run it without TRITON_INTERPRET=1")
    rows = report()
    print("quantize + pack: x fp16 [8, 32, 4096, 128], G = 32, instructions per element (one thread's share)")
    print("decode attention: head_dim 128, G = 32, R = 128, the fast-tile loop's warp-instructions per (token, KV head)")
    for row in rows:
        cost = f"{row['per_element']:.1f} per element" if row["kernel"] == "quantize" else f"{row['per_token']:.1f} per token"
        top = ", ".join(f"{op} {n}" for op, n in row["mix"].most_common(10))
        print(f"{row['kernel']:8} {row['case']:22} {row['registers']:3d} regs {row['spill_bytes']:4d} B spilled  {cost}  [{top}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
