"""Each kernel compiles once per model shape and cache configuration, not once per length pattern.

Triton compiles a kernel again for every new pattern of its integer arguments (equal to 1, divisible by 16)
unless they are marked ``do_not_specialize``. Arguments that follow prompt lengths, batch, split counts or
buffer capacities would make a run recompile (seconds each on the GPU) whenever a new length comes along.
Here every launch is recorded instead of run, and its compile key computed for an sm_90 GPU, as Triton's
launcher computes it there.
"""

import pytest
import torch
import triton

import kivi.kernels._triton as triton_helpers
import kivi.kernels.decode_attention as decode_module
import kivi.kernels.dense_decode as dense_module
import kivi.kernels.quantize as quantize_module
from kivi import backend
from kivi.config import KiviConfig
from kivi.quant import allocate
from tools.kernel_data import fill_streams, outlier_kv
from tools.sass import Launches, compile_key


@pytest.fixture
def record(monkeypatch):
    """record(module, kernel name) -> a function giving the compile keys of the launches made since."""
    def record(module, name: str):
        launches = Launches(getattr(module, name))
        monkeypatch.setattr(module, name, launches)
        return lambda: [compile_key(launches.kernel, *args, **kwargs) for args, kwargs in launches.calls]

    return record


def test_decode_attention_compiles_once_per_split_mode(record):
    decode = record(decode_module, "_decode_kernel")
    merge = record(triton_helpers, "_merge_kernel")
    config = KiviConfig(group_size=32, residual_length=32)
    gen = torch.Generator().manual_seed(0)
    merged_splits = []
    # Lengths whose capacities (rows of codes, scales, residuals) fall on every side of 1 and of multiples of 16.
    for lengths in ([611, 77, 333], [992], [1022, 4], [2016, 2046, 100, 3]):
        keys, values = outlier_kv(len(lengths), 2, max(lengths), 64, torch.float16, "cpu", gen)
        key_stream, value_stream = fill_streams(keys, values, lengths, config)
        query = torch.randn(len(lengths), 4, 1, 64, generator=gen).half()
        for num_splits in (1, 2, 3, 5, 16):
            backend.decode_attention(query, key_stream, value_stream, 0.125, num_splits=num_splits)
            merged_splits += [num_splits] if num_splits > 1 else []
    keys = decode()
    assert len(keys) == 20 and len(set(keys)) == 2  # one split, or several (partials + merge)
    assert len(set(merge())) == len({triton.next_power_of_2(s) for s in merged_splits})


def test_dense_decode_compiles_once_per_split_mode(record):
    dense = record(dense_module, "_dense_decode_kernel")
    record(triton_helpers, "_merge_kernel")
    gen = torch.Generator().manual_seed(1)
    for batch, capacity in ((1, 100), (3, 128), (4, 1000), (16, 4096)):
        keys, values = outlier_kv(batch, 2, capacity, 64, torch.float16, "cpu", gen)
        query = torch.randn(batch, 4, 1, 64, generator=gen).half()
        lengths = torch.randint(1, capacity + 1, (batch,), generator=gen, dtype=torch.int32)
        for num_splits in (1, 3, 16):
            dense_module.dense_decode_attention(query, keys, values, lengths, 0.125, num_splits)
    keys = dense()
    assert len(keys) == 12 and len(set(keys)) == 2


@pytest.mark.parametrize("axis, token_counts", [("channel", (32, 96, 160, 1024, 4064)), ("token", (1, 7, 100, 4093, 4096))])
def test_quantize_compiles_once_per_axis(record, axis, token_counts):
    name = "_quantize_channel_kernel" if axis == "channel" else "_quantize_token_kernel"
    launches = record(quantize_module, name)
    gen = torch.Generator().manual_seed(2)
    for tokens in token_counts:
        quantize_module.quantize(torch.randn(2, 3, tokens, 64, generator=gen).half(), 2, 32, axis)
    keys = launches()
    assert len(keys) == len(token_counts) and len(set(keys)) == 1


def test_append_compiles_once_per_configuration(record):
    append = record(quantize_module, "_append_kernel")
    batch, heads, dim, group, window = 2, 3, 64, 32, 32
    for capacity in (32, 416, 512, 4096, 4128):
        keys = allocate((batch, heads, capacity, dim), 2, group, "channel", torch.float16, "cpu")
        values = allocate((batch, heads, capacity, dim), 2, group, "token", torch.float16, "cpu")
        key_resid = torch.randn(batch, heads, group, dim).half()
        value_ring = torch.randn(batch, heads, window + 1, dim).half()
        positions = torch.tensor([capacity - 1, capacity // 2], dtype=torch.int32)
        key, value = torch.randn(2, batch, heads, dim).half()
        quantize_module.append_step(key, value, key_resid, value_ring, keys, values, positions,
                                    KiviConfig(k_bits=2, v_bits=2, group_size=group, residual_length=window))
    keys = append()
    assert len(keys) == 5 and len(set(keys)) == 1
