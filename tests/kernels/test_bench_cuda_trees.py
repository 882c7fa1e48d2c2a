"""tools.bench_cuda_trees times another checkout's kernels with this checkout's benchmark: checked on the CPU where a
child process's imports resolve (the timing itself needs the GPU)."""

import shutil
import subprocess
import sys

from tools.trees import REPO


def test_a_tree_child_times_that_trees_kernels_with_this_checkouts_benchmark(tmp_path):
    shutil.copytree(REPO / "kivi", tmp_path / "kivi", ignore=shutil.ignore_patterns("__pycache__"))
    probe = ("from pathlib import Path; from tools.bench_cuda_trees import kernels_of; "
             f"bench, cuda = kernels_of(Path({str(tmp_path)!r})); import kivi.kernels.decode_attention as triton_kernel; "
             "print(bench.__file__); print(cuda.__file__); print(triton_kernel.__file__)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    bench, cuda, triton_kernel = done.stdout.split()
    assert bench == str(REPO / "tools" / "kernel_bench.py")
    assert cuda == str(tmp_path / "kivi" / "kernels" / "cuda_decode.py")
    assert triton_kernel == str(tmp_path / "kivi" / "kernels" / "decode_attention.py")
