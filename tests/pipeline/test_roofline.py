"""The roofline's byte and FLOP counts, checked against hand counts."""

from transformers import LlamaConfig

from kivi import KiviConfig
from tools.roofline import kv_bytes_per_token_head, meta_model, step_cost


def test_kv_bytes_follow_the_flush_rules():
    # fp16: keys and values of every token, 2 bytes each.
    assert kv_bytes_per_token_head(100, None, 128) == 2 * 100 * 128 * 2
    # KIVI-2, G = 32, R = 32, 100 tokens (position 99 just appended): keys 96 quantized + 4 full; values 67 + 33.
    per_quantized = 128 * (2 / 8 + 2 * 2 / 32)
    expected = 96 * per_quantized + 67 * per_quantized + (4 + 33) * 128 * 2
    assert kv_bytes_per_token_head(100, KiviConfig(residual_length=32), 128) == expected
    # A short sequence is all full precision.
    assert kv_bytes_per_token_head(20, KiviConfig(residual_length=32), 128) == kv_bytes_per_token_head(20, None, 128)


def test_step_cost_counts_weights_kv_and_flops():
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    weights = 2 * 100 * 64 + 2 * (4 * 64 * 64 // 2 + 2 * 64 * 64 // 2 + 3 * 64 * 128 + 2 * 64) + 64  # + norms
    cost = step_cost(meta_model(config), None, prompt_lens=[10, 30], gen_len=3)  # steps see contexts 11, 12 and 31, 32
    assert cost.weight_bytes == 2 * weights
    assert cost.kv_bytes == 2 * 2 * (11 + 12 + 31 + 32) * 2 * 16 * 2 / 2
    matmul = weights - 100 * 64
    assert cost.flops == 2 * matmul * 2 + 4 * 2 * 4 * 16 * (11 + 12 + 31 + 32) / 2
