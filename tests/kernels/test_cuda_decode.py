"""The CUDA C++ decode attention (kivi/kernels/csrc) against the oracle, run on the CPU: the same source compiled as
C++ over a software warp (emulate.h: every thread a fiber, shuffles, votes and the tensor-core product as
rendezvous of its 32 lanes). On the GPU, ``python -m tools.kernel_check`` compares the nvcc build with the oracle
and with the Triton kernel; here the GPU build is compiled (CI catches its compile errors) but not run."""

import ctypes
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import MistralConfig

from kivi import backend
from kivi.config import KiviConfig
from kivi.kernels import cuda_decode
from kivi.quant import Quantized
from kivi.slot_cache import SlotCache
from tools import kernel_bench
from tools.decode_precision import variant_errors
from tools.kernel_data import REAL_KV, fill_streams, outlier_kv, reference_decode, relative_error

TOLERANCE = 1e-3  # relative error of the float32 output vs the float32 oracle, as for the Triton kernel


def emulated(query, key_stream, value_stream, config, num_splits, out_dtype=torch.float32, softcap=None, warps=4,
             value_buffers=None):
    """The kernel over two KVStreams (as backend.decode_attention hands them over), output poisoned first;
    ``value_buffers``: in place of the value stream's own."""
    after_sink = [q + r for q, r in zip(key_stream.n_quant, key_stream.n_resid)]
    counts = torch.tensor([key_stream.n_sink, key_stream.n_quant, value_stream.n_quant, after_sink], dtype=torch.int32)
    out = torch.full(query.shape, float("nan"), dtype=out_dtype)
    cuda_decode.decode_attention(query, key_stream.buffers, value_buffers or value_stream.buffers, counts, config,
                                 query.shape[-1] ** -0.5, num_splits, out, softcap=softcap, emulate=True, warps=warps)
    assert not out.isnan().any(), f"{out.isnan().sum().item()} output elements left unwritten"
    return out


def random_case(heads, lengths, config, seed):
    q_heads, kv_heads, dim = heads
    gen = torch.Generator().manual_seed(seed)
    keys, values = outlier_kv(len(lengths), kv_heads, max(lengths), dim, torch.float16, "cpu", gen)
    query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen).half()
    return (query, *fill_streams(keys, values, lengths, config))


HEADS = {  # (query heads, KV heads, head_dim): one and two column tiles of heads, both head sizes
    "MHA 2/2x128": (2, 2, 128),
    "GQA 12/2x128 (Qwen2.5-1.5B)": (12, 2, 128),
    "MQA 4/1x256": (4, 1, 256),
    "GQA 6/2x256": (6, 2, 256),
}
CONFIGS = {"kivi-2": KiviConfig(), "kivi-4": KiviConfig(k_bits=4, v_bits=4), "kivi-2 R32": KiviConfig(residual_length=32)}
# Ragged: a residual only, a value window past the last quantized key group, units of 64 that end mid-group.
LENGTHS = [331, 5, 200]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("heads", list(HEADS))
def test_the_cuda_kernel_matches_the_oracle(heads, config, num_splits):
    query, ks, vs = random_case(HEADS[heads], LENGTHS, CONFIGS[config], seed=len(heads) + len(config))
    out = emulated(query, ks, vs, CONFIGS[config], num_splits)
    assert relative_error(out, reference_decode(query, ks, vs, query.shape[-1] ** -0.5)) <= TOLERANCE


def test_value_buffers_of_an_odd_row_count_are_read_where_their_scales_lie_off_16_byte_alignment():
    """Value buffers as a cache of 895 quantized values holds them, 895 rows: every other (sequence, head)'s scales
    and zeros start 8 bytes past a 16-byte boundary, and its units stage them in 8-byte pieces (16-byte copies
    would fault; the emulation stops on a misaligned copy)."""
    query, ks, vs = random_case(HEADS["MHA 2/2x128"], [1024, 900, 1000], CONFIGS["kivi-2"], seed=7)
    rows = max(vs.n_quant)
    assert rows % 2 == 1
    trimmed = vs.buffers._replace(packed=Quantized(*(x[:, :, :rows].contiguous() for x in vs.buffers.packed)))
    out = emulated(query, ks, vs, CONFIGS["kivi-2"], num_splits=1, value_buffers=trimmed)
    assert relative_error(out, reference_decode(query, ks, vs, query.shape[-1] ** -0.5)) <= TOLERANCE


@pytest.mark.parametrize("warps", [2, 8])
@pytest.mark.parametrize("heads, config", [("GQA 12/2x128 (Qwen2.5-1.5B)", "kivi-2"), ("MHA 2/2x128", "kivi-4"),
                                           ("MQA 4/1x256", "kivi-2")])
def test_blocks_of_two_and_eight_warps_match_the_oracle(heads, config, warps):
    """Each warp takes every second (eighth) unit: ten or eleven (two or three) of the longest sequence's 21, its
    last ones partial; the block merges two (eight) online softmaxes."""
    query, ks, vs = random_case(HEADS[heads], [1300, 331, 5], CONFIGS[config], seed=5)
    out = emulated(query, ks, vs, CONFIGS[config], num_splits=1, warps=warps)
    assert relative_error(out, reference_decode(query, ks, vs, query.shape[-1] ** -0.5)) <= TOLERANCE


def test_a_block_size_the_layout_does_not_take_is_refused():
    query, ks, vs = random_case(HEADS["MQA 4/1x256"], [40], CONFIGS["kivi-4"], seed=1)
    counts = torch.tensor([[0], [0], [0], [40]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"warps=8; this layout takes \[2, 4\]"):  # 4-bit head_dim 256: 320 KB at 8
        cuda_decode.decode_attention(query, ks.buffers, vs.buffers, counts, CONFIGS["kivi-4"], 0.1, 1, emulate=True,
                                     warps=8)


def h200(monkeypatch, shared_per_sm: int = 228 * 1024) -> SimpleNamespace:
    """The H200's 132 multiprocessors and shared memory, the block sizes from the emulation build (the same source)."""
    emulation = cuda_decode.library(emulate=True)
    monkeypatch.setattr(cuda_decode, "_library_for", lambda device: emulation)
    props = SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=shared_per_sm)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    return props


def test_eight_warps_serve_blocks_no_more_than_the_multiprocessors_where_the_device_holds_them(monkeypatch):
    """Eight warps per block where the blocks fit one per multiprocessor with a unit per warp, and the block fits
    the device's shared memory: the H200's 228 KB, compute capability 8.6's 100 KB (4-bit head_dim 256: no); two
    for more than 4 query heads per KV head at more than two blocks per multiprocessor."""
    props = h200(monkeypatch)
    cuda, kivi2, kivi4, qwen = torch.device("cuda"), CONFIGS["kivi-2"], CONFIGS["kivi-4"], (1, 12, 1, 128)
    assert cuda_decode.default_warps(64, 2, 1, 1024, kivi2, qwen, cuda) == 8
    assert cuda_decode.default_warps(64, 2, 2, 1024, kivi2, qwen, cuda) == 4  # 256 blocks
    assert cuda_decode.default_warps(64, 2, 3, 1024, kivi2, qwen, cuda) == 2  # 384 blocks
    assert cuda_decode.default_warps(256, 2, 1, 1024, kivi2, qwen, cuda) == 2
    assert cuda_decode.default_warps(256, 8, 1, 1024, kivi2, (1, 32, 1, 128), cuda) == 4  # 4 query heads per KV head
    assert cuda_decode.default_warps(2, 2, 33, 1024, kivi2, qwen, cuda) == 4  # under one unit per warp
    assert cuda_decode.default_warps(64, 1, 1, 1024, kivi4, (1, 4, 1, 256), cuda) == 4  # 8 warps do not fit
    assert cuda_decode.fits(kivi4, (1, 4, 1, 256), 1, cuda)
    props.shared_memory_per_multiprocessor = 100 * 1024
    assert not cuda_decode.fits(kivi4, (1, 4, 1, 256), 1, cuda)
    assert cuda_decode.fits(kivi2, qwen, 2, cuda, warps=8)  # 96 KB


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def sweep_rows(name: str) -> dict[tuple[str, int, int], dict[tuple[int, int], float]]:
    """A committed ``tools.kernel_bench --sweep``: {(shape, batch, tokens): {(splits, warps): ms}}."""
    sizes = {}
    for r in json.loads((BENCHMARKS / name).read_text())["sweep"]:
        sizes.setdefault((r["shape"], r["batch"], r["tokens"]), {})[r["splits"], r["warps"]] = r["cuda2_ms"]
    return sizes


def launch(shape: str, batch: int, tokens: int) -> tuple[int, int]:
    q_heads, kv_heads, dim = kernel_bench.SHAPES[shape]
    return cuda_decode.default_launch(batch, kv_heads, tokens, CONFIGS["kivi-2"], (batch, q_heads, 1, dim),
                                      torch.device("cuda"))


def test_the_default_split_count_is_the_best_the_h200_sweep_of_splits_and_block_sizes_measured(monkeypatch):
    """default_launch against the H200 sweep at 5d38c0c (Qwen2.5-1.5B's shape, 1-4 splits x 4 and 8 warps): its
    split count, and 8 warps or not, are those of the fastest launch at each size."""
    h200(monkeypatch)
    for (shape, batch, tokens), timed in sweep_rows("2026-12-03-cuda-decode-warps-sweep.json").items():
        splits, warps = launch(shape, batch, tokens)
        best = min(timed, key=timed.get)
        assert (splits, warps == 8) == (best[0], best[1] == 8), ((batch, tokens), (splits, warps), timed)


def test_the_default_block_size_is_the_fastest_the_sweep_of_2_4_and_8_warps_measured_at_its_split_count(monkeypatch):
    """default_launch against the H100 sweep at 2c28ce7 (GQA layouts of 12 / 2, 28 / 4 and 32 / 8 heads, 64-512
    sequences of 384-4,096 tokens; both GPUs have 132 multiprocessors): at the split count it takes, its block size
    ran within 1% of the fastest of 2, 4 and 8 warps."""
    h200(monkeypatch)
    for size, timed in sweep_rows("2026-12-07-cuda-decode-warps-sweep-h100.json").items():
        splits, warps = launch(*size)
        fastest = min(ms for (s, _), ms in timed.items() if s == splits)
        assert timed[splits, warps] <= 1.01 * fastest, (size, (splits, warps), timed)


def test_the_default_launch_splits_only_to_fill_the_gpu_as_the_sweep_over_lengths_measured(monkeypatch):
    """default_launch against the H100 sweep over lengths at ad68753 (64-512 sequence heads of 12 / 2, 32 / 32 and
    32 / 8 heads, 2K-32K tokens; 1-17 splits x 2, 4 and 8 warps): the fastest launch up to 8,192 tokens, within 3% of
    it at every size (where a warp's chain passes 64 units the longer rule splits further)."""
    h200(monkeypatch)
    for size, timed in sweep_rows("2026-12-07-cuda-decode-split-lengths-h100.json").items():
        chosen, fastest = timed[launch(*size)], min(timed.values())
        assert chosen <= 1.03 * fastest, (size, launch(*size), timed)
        if size[2] <= 8192:
            assert chosen == fastest, (size, launch(*size), timed)


def test_the_cuda_kernel_soft_caps_and_rounds_to_fp16():
    config = KiviConfig(residual_length=32)
    query, ks, vs = random_case(HEADS["GQA 12/2x128 (Qwen2.5-1.5B)"], [97, 260], config, seed=3)
    ref = reference_decode(query, ks, vs, query.shape[-1] ** -0.5, softcap=8.0)
    capped = emulated(query, ks, vs, config, num_splits=1, softcap=8.0)
    assert relative_error(capped, ref) <= TOLERANCE
    assert relative_error(emulated(query, ks, vs, config, num_splits=1), ref) > 10 * TOLERANCE  # the cap matters here
    rounded = emulated(query, ks, vs, config, num_splits=1, out_dtype=torch.float16, softcap=8.0)
    assert rounded.dtype == torch.float16 and torch.equal(rounded, capped.half())


@pytest.mark.parametrize("config", ["kivi-2", "kivi-4"])
def test_the_cuda_kernel_on_real_keys_and_values(config):
    # SmolLM2-135M's heads are 64 wide; zero channels (as the slot cache pads Phi-3's 96) leave attention unchanged.
    data = torch.load(REAL_KV)
    lengths = [256, 229, 197]
    keys, values, queries = (torch.nn.functional.pad(data[k].half(), (0, 64)) for k in ("keys", "values", "queries"))
    first = keys.shape[2] - queries.shape[2]
    query = torch.stack([queries[b, :, n - 1 - first] for b, n in enumerate(lengths)]).unsqueeze(2)
    ks, vs = fill_streams(keys, values, lengths, CONFIGS[config])
    out = emulated(query, ks, vs, CONFIGS[config], num_splits=2)
    assert relative_error(out, reference_decode(query, ks, vs, query.shape[-1] ** -0.5)) <= TOLERANCE


@pytest.mark.parametrize("warps", [2, 4])
def test_the_slot_cache_steps_on_the_cuda_kernel_as_on_the_oracle(monkeypatch, warps):
    """Decode steps of the engine's cache: the value window as a ring, the step's token stored, flushes between;
    blocks of 4 warps, and of 2 (the default launch's for this layout at many slots)."""
    def on_the_cuda_kernel(query, keys, values, counts, config, scaling, max_tokens, out=None, v_ring=False,
                           softcap=None, num_splits=None, kernel="auto"):
        splits = cuda_decode.default_num_splits(query.shape[0], keys.resid.shape[1], max_tokens, query.device)
        return cuda_decode.decode_attention(query, keys, values, counts, config, scaling, splits, out, v_ring=v_ring,
                                            softcap=softcap, emulate=True, warps=warps)

    monkeypatch.setattr(backend, "decode", on_the_cuda_kernel)
    gen = torch.Generator().manual_seed(0)
    q_heads, kv_heads, dim, lengths = 12, 2, 128, [317, 129, 37]
    config = MistralConfig(hidden_size=q_heads * dim, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                           head_dim=dim, num_hidden_layers=1, intermediate_size=16, vocab_size=16, sliding_window=None)
    kivi = KiviConfig(residual_length=32)
    keys, values = outlier_kv(len(lengths), kv_heads, max(lengths), dim, torch.float16, "cpu", gen)
    caches = [SlotCache(config, len(lengths), max(lengths) + 40, torch.float16, "cpu", kivi, use_kernels)
              for use_kernels in (True, False)]
    for cache in caches:
        cache.load(torch.arange(len(lengths)), [(keys, values)], torch.tensor(lengths))
    for _ in range(4):  # position 319 fills a key block (flushed), every step moves a value out of the ring
        query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen).half()
        key, value = outlier_kv(len(lengths), kv_heads, 1, dim, torch.float16, "cpu", gen)
        kernel, oracle = (cache.layers[0].attend(query, key, value, dim**-0.5, 8.0) for cache in caches)
        for cache in caches:
            cache.advance()
        assert relative_error(kernel.float(), oracle.float()) <= 2 * TOLERANCE  # both rounded to fp16


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=torch.bfloat16), "fp16 only"),
    (dict(config=KiviConfig(k_bits=8, v_bits=8)), "2 or 4 bits"),
    (dict(config=KiviConfig(k_bits=2, v_bits=4)), "the same for both"),
    (dict(config=KiviConfig(group_size=64)), "32 only"),
    (dict(config=KiviConfig(sink_tokens=4)), "sink tokens"),
    (dict(shape=(1, 4, 1, 64)), "head_dim=64"),
    (dict(shape=(1, 18, 1, 128)), "at most 8 per KV head"),
    (dict(shape=(1, 4, 2, 128)), "decode only"),
])
def test_what_the_cuda_kernel_does_not_serve_is_named(change, reason):
    case = dict(config=KiviConfig(), shape=(1, 4, 1, 128), kv_heads=2, dtype=torch.float16) | change
    assert reason in (cuda_decode.unsupported(case["config"], case["shape"], case["kv_heads"], case["dtype"]) or "")
    assert cuda_decode.unsupported(KiviConfig(), (1, 4, 1, 128), 2, torch.float16) is None


def test_the_backend_leaves_cpu_tensors_to_the_triton_kernel():
    cpu = torch.zeros(1, 12, 1, 128, dtype=torch.float16)
    assert not backend.serves_cuda(KiviConfig(), cpu, 2, torch.float16)  # the interpreter runs Triton's


def test_cpu_tensors_need_the_emulation():
    query, ks, vs = random_case(HEADS["MHA 2/2x128"], [40], CONFIGS["kivi-2"], seed=1)
    counts = torch.tensor([[0], [0], [0], [40]], dtype=torch.int32)
    with pytest.raises(ValueError, match="without emulate"):
        cuda_decode.decode_attention(query, ks.buffers, vs.buffers, counts, CONFIGS["kivi-2"], 0.1, 1)


SPLIT_SWEEP = Path(__file__).resolve().parents[2] / "benchmarks" / "2026-12-03-cuda-decode-split-sweep-values-in-place.json"


def test_the_default_split_count_is_near_the_best_the_h200_sweep_measured(monkeypatch):
    """The rule against the committed sweep (tools.kernel_bench --sweep on the H200, 132 SMs): at every size its
    choice ran within 4% of the best split count measured (at the short contexts of the engine, the best)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    rows = json.loads(SPLIT_SWEEP.read_text())["sweep"]
    heads = {"llama2-7b": 32, "gqa-32/8": 8, "qwen2.5-1.5b": 2}
    for size in {(r["shape"], r["batch"], r["tokens"]) for r in rows}:
        timed = {r["splits"]: r["cuda2_ms"] for r in rows if (r["shape"], r["batch"], r["tokens"]) == size}
        shape, batch, tokens = size
        chosen = cuda_decode.default_num_splits(batch, heads[shape], tokens, torch.device("cuda"))
        assert timed[chosen] <= 1.04 * min(timed.values()), (size, chosen, timed)
        if tokens <= 1024:
            assert timed[chosen] <= 1.005 * min(timed.values()), (size, chosen, timed)


@pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc is not installed: the GPU build is not compiled here")
def test_the_gpu_build_compiles_exports_its_entry_points_and_spills_nothing_at_head_dim_128(tmp_path):
    """nvcc for sm_90 (the H200's), as the first use on a GPU host builds it; ctypes resolves the entry points
    without a GPU. Spills at head_dim 128 would put per-token loads in local memory on the hot path."""
    library = tmp_path / "kivi_decode.so"
    command = cuda_decode.build_command(library, emulate=False, arch="90")
    done = subprocess.run([*command, "-Xptxas", "-v"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lib = ctypes.CDLL(str(library))
    lib.kivi_decode_error.restype = ctypes.c_char_p
    assert lib.kivi_decode and lib.kivi_decode_error(0) == b"no error"  # cudaGetErrorString(cudaSuccess), no GPU needed
    # ptxas reports each instantiation (decode_kernelILi<bits>ELi<head_dim>ELi<column tiles>ELi<warps>) with its
    # spills: 2 and 4 warps for every layout, 8 where their stages fit (all but 4-bit head_dim 256)
    reports = re.findall(r"decode_kernelILi(\d)ELi(\d+)ELi(\d)ELi(\d).*?(\d+) bytes spill stores", done.stderr, re.S)
    assert sorted((bits, dim, warps) for bits, dim, tiles, warps, _ in reports) == sorted(
        (bits, dim, warps) for bits in "24" for dim in ("128", "256") for warps in "248" for _ in range(2)
        if (bits, dim, warps) != ("4", "256", "8"))
    assert all(spills == "0" for bits, dim, tiles, warps, spills in reports if dim == "128")


def test_the_kernels_roundings_are_the_ones_the_precision_budget_allows():
    """Why the key products take q * s in hi and lo parts, and the value products p * s with a factor on p
    (tools.decode_precision): on outlier keys, fp16 keys or one fp16 part of q * s err near or past the bar, the
    kernel's choices below it; without the factor, p * s of small value scales falls among fp16's subnormals."""
    gen = torch.Generator().manual_seed(0)
    keys, values = outlier_kv(1, 2, 1024, 128, torch.float16, "cpu", gen)
    query = torch.randn(1, 8, 128, generator=gen).half()
    errors = variant_errors(query, keys, values)
    assert errors["q*s fp16"] > TOLERANCE and errors["keys fp16"] > TOLERANCE / 2
    assert errors["q*s hi/lo"] < 1e-6 and errors["p*s fp16"] < TOLERANCE / 2
    small = variant_errors(query, keys, (values.float() * 1e-4).half())
    assert small["p*s fp16 x1"] > 5 * TOLERANCE and small["p*s fp16"] < TOLERANCE


@pytest.mark.parametrize("value_scale", [1e-4, 1e3])
def test_the_cuda_kernel_on_values_of_tiny_and_huge_scales(value_scale):
    """p * s is an fp16 operand: the probabilities' factor follows the largest value scale, so that tiny scales
    stay out of fp16's subnormals (a fixed factor of 1 errs 3.6e-3 here) and huge ones do not overflow (one of 2^15
    makes NaN here)."""
    config = KiviConfig()
    gen = torch.Generator().manual_seed(1)
    keys, values = outlier_kv(2, 1, 2048, 128, torch.float16, "cpu", gen)
    query = torch.randn(2, 4, 1, 128, generator=gen).half()
    ks, vs = fill_streams(keys, (values.float() * value_scale).half(), [2048, 1500], config)
    out = emulated(query, ks, vs, config, num_splits=2)
    assert relative_error(out, reference_decode(query, ks, vs, query.shape[-1] ** -0.5)) <= TOLERANCE
