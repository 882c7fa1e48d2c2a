import pytest
import torch

from kivi.config import StreamConfig
from kivi.stream import KVStream

HEADS, DIM = 2, 64


def _tokens(n, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, HEADS, n, DIM, generator=g)


def _expected(n, axis, group, residual):
    """(quantized, residual) token counts of KIVI's flush rules after n tokens."""
    if axis == "channel":
        block = residual or group
        return n // block * block, n % block
    return max(n - residual, 0), min(n, residual)


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("prefill, group, residual", [(1, 32, 128), (300, 32, 128), (256, 32, 128), (97, 16, 32), (50, 32, 0), (130, 32, 32)])
def test_lengths_follow_the_flush_rules_after_prefill_and_every_decode_step(axis, prefill, group, residual):
    stream = KVStream(StreamConfig(2, group, residual, axis, sink_tokens=0))
    stream.append(_tokens(prefill), None)
    stream.flush()
    assert (stream.n_quant[0], stream.n_resid[0]) == _expected(prefill, axis, group, residual)
    for step in range(1, 140):
        stream.append(_tokens(1, seed=step), None)
        stream.flush()
        assert (stream.n_quant[0], stream.n_resid[0]) == _expected(prefill + step, axis, group, residual), step


def test_keys_are_quantized_all_at_once_when_the_residual_reaches_r():
    stream = KVStream(StreamConfig(2, 32, 128, "channel", sink_tokens=0))
    stream.append(_tokens(127), None)
    stream.flush()
    assert (stream.n_quant[0], stream.n_resid[0]) == (0, 127)
    stream.append(_tokens(1, seed=1), None)
    stream.flush()
    assert (stream.n_quant[0], stream.n_resid[0]) == (128, 0)


def test_sink_tokens_stay_full_precision_and_the_rules_apply_after_them():
    x = _tokens(200)
    stream = KVStream(StreamConfig(2, 32, 32, "token", sink_tokens=4))
    stream.append(x, None)
    stream.flush()
    assert (stream.n_sink[0], stream.n_quant[0], stream.n_resid[0]) == (4, 164, 32)
    restored = stream.materialize()
    assert torch.equal(restored[:, :, :4], x[:, :, :4])  # sinks exact
    assert torch.equal(restored[:, :, -32:], x[:, :, -32:])  # residual exact
    assert not torch.equal(restored[:, :, 4:-32], x[:, :, 4:-32])  # the middle is quantized


def test_sixteen_bits_never_quantize():
    stream = KVStream(StreamConfig(16, 32, 128, "channel", sink_tokens=0))
    x = _tokens(500)
    stream.append(x, None)
    stream.flush()
    assert (stream.n_quant[0], stream.n_resid[0]) == (0, 500)
    assert torch.equal(stream.materialize(), x)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_a_padded_sequence_is_stored_exactly_as_if_it_ran_alone(axis):
    lengths = [150, 71, 200]
    padded = _tokens(200, batch=3)
    valid = torch.arange(200)[None, :] >= torch.tensor([200 - n for n in lengths])[:, None]  # left padding
    padded[~valid[:, None, :, None].expand_as(padded)] = 1e4  # padding must never reach min/max
    batch = KVStream(StreamConfig(2, 32, 32, axis, sink_tokens=0))
    batch.append(padded, valid)
    batch.flush()
    for b, n in enumerate(lengths):
        alone = KVStream(StreamConfig(2, 32, 32, axis, sink_tokens=0))
        alone.append(padded[b : b + 1, :, 200 - n :], None)
        alone.flush()
        assert (batch.n_quant[b], batch.n_resid[b]) == (alone.n_quant[0], alone.n_resid[0])
        assert torch.equal(batch.materialize()[b, :, :n], alone.materialize()[0])
    assert batch.materialize().abs().max() < 1e3


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_nbytes_is_codes_plus_scales_plus_zeros_plus_residual(bits):
    n, group, residual = 300, 32, 128
    stream = KVStream(StreamConfig(bits, group, residual, "channel", sink_tokens=0))
    stream.append(_tokens(n, batch=2).to(torch.bfloat16), None)
    stream.flush()
    quant = (n // residual * residual if bits < 16 else 0) * HEADS * DIM * 2  # elements, both sequences
    full = (n * HEADS * DIM * 2) - quant
    assert stream.nbytes() == quant * bits // 8 + 2 * (quant // group) * 2 + full * 2


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_the_incremental_view_equals_one_rebuilt_from_the_packed_storage(axis):
    stream = KVStream(StreamConfig(2, 32, 64, axis, sink_tokens=3))
    stream.append(_tokens(70, batch=2), None)
    stream.flush()
    stream.materialize()  # from here on the view is updated at each append and flush
    for step in range(150):
        stream.append(_tokens(1, batch=2, seed=step + 1), None)
        stream.flush()
    incremental = stream.materialize().clone()
    stream.view = None
    assert torch.equal(stream.materialize(), incremental)
