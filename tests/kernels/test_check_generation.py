"""tools.check_generation's diagnosis of a divergence (quantized elements that differ between two caches), and
tools.widen_heads, which lets a small real model run on a kernel of a larger head size."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kivi import enable_kivi
from tools.check_generation import _generate, _quantized_differences
from tools.widen_heads import widen_heads


def test_quantized_differences_sees_one_flipped_code_and_nothing_else():
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    enable_kivi(model)
    ids = torch.randint(0, 256, (1, 300))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two runs bit for bit: once in a whole-suite run on two threads they were not
    try:
        with torch.inference_mode():
            _, _, first = _generate(model, ids, False, 40)
            _, _, second = _generate(model, ids, False, 40)
            same, compared = _quantized_differences(first, second, 340)
            second.layers[1].key_stream.packed.codes[0, 1, 3, 5] ^= 1  # one 2-bit code of one key
            flipped, _ = _quantized_differences(first, second, 340)
    finally:
        torch.set_num_threads(threads)
    assert compared > 2 * 2 * 2 * 64 * 128  # keys and values of both layers, hundreds of quantized tokens each
    assert same == 0 and flipped == 1


def test_widened_heads_compute_the_same_logits_and_hold_zeros_in_their_new_channels():
    """tools.widen_heads: heads of 32 widened to 64 by zero channels placed at the rotary frequencies of the old ones.
    (Under KIVI the widened model is another model: a value group of 32 channels holds 16 old ones and 16 zeros.)"""
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 256, (1, 200))
    with torch.inference_mode():
        before = model(ids).logits
        tokens = model.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=0)
        widen_heads(model, 64)
        after = model(ids).logits
        widened = model.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=0, return_dict_in_generate=True)
    keys = widened.past_key_values.layers[0].keys
    assert keys.shape[-1] == 64 and keys[..., 1::2].abs().max() == 0 and keys[..., ::2].abs().min() > 0
    assert (after - before).abs().max() <= 1e-4 * before.abs().max()
    assert torch.equal(widened.sequences, tokens)


def test_a_widening_that_would_change_the_model_is_refused():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=32))
    with pytest.raises(ValueError, match="multiple of the head size 32"):
        widen_heads(model, 48)
    model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        widen_heads(model, 64)
