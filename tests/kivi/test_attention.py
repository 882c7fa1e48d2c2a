import pytest
import torch
import torch.nn.functional as F

from kivi.attention import attention_over_cache
from kivi.config import StreamConfig
from kivi.stream import KVStream


def _filled_streams(lengths, kv_heads, dim, q_len, seed):
    """Key/value streams holding ragged sequences (left-padded prefill, then q_len decode tokens)."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    keys = KVStream(StreamConfig(2, 32, 32, "channel", sink_tokens=2))
    values = KVStream(StreamConfig(2, 32, 32, "token", sink_tokens=2))
    valid = torch.arange(longest)[None] >= torch.tensor([longest - n for n in lengths])[:, None]
    for stream in (keys, values):
        x = torch.randn(len(lengths), kv_heads, longest, dim, generator=g)
        x[..., 1] *= 10  # an outlier channel
        stream.append(x, valid)
        stream.flush()
        stream.append(torch.randn(len(lengths), kv_heads, q_len, dim, generator=g), None)
    return keys, values


@pytest.mark.parametrize("q_heads, kv_heads", [(8, 2), (4, 4), (6, 1)])  # GQA, MHA, MQA
@pytest.mark.parametrize("q_len", [1, 3])
def test_attention_over_the_cache_equals_dequantize_then_sdpa_per_sequence(q_heads, kv_heads, q_len):
    lengths, dim = [97, 40, 130], 64
    keys, values = _filled_streams(lengths, kv_heads, dim, q_len, seed=q_heads + q_len)
    query = torch.randn(len(lengths), q_heads, q_len, dim)
    held = torch.tensor(keys.lengths)
    out = attention_over_cache(query, keys.materialize(), values.materialize(), held, dim**-0.5)
    for b, n in enumerate(held.tolist()):
        k = keys.materialize()[b : b + 1, :, :n].repeat_interleave(q_heads // kv_heads, dim=1)
        v = values.materialize()[b : b + 1, :, :n].repeat_interleave(q_heads // kv_heads, dim=1)
        causal = torch.ones(q_len, n, dtype=torch.bool).tril(diagonal=n - q_len)
        ref = F.scaled_dot_product_attention(query[b : b + 1], k, v, attn_mask=causal)
        torch.testing.assert_close(out[b : b + 1], ref, atol=2e-5, rtol=1e-5)


def test_one_softmax_spans_the_quantized_segment_and_the_residual():
    keys, values = _filled_streams([200], 1, 64, 1, seed=7)
    assert keys.n_quant[0] > 0 and keys.n_resid[0] > 0
    query = torch.randn(1, 1, 1, 64) * 3
    k, v = keys.materialize(), values.materialize()
    out = attention_over_cache(query, k, v, torch.tensor(keys.lengths), 0.125)
    # Normalizing each segment separately (the bug) gives another answer.
    split = keys.n_sink[0] + keys.n_quant[0]
    parts = [(k[..., s, :], v[..., s, :]) for s in (slice(0, split), slice(split, None))]
    per_segment = sum(torch.softmax(query @ kk.transpose(-1, -2) * 0.125, -1) @ vv for kk, vv in parts)
    assert not torch.allclose(out, per_segment, atol=1e-3)
