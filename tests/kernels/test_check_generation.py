"""tools.check_generation's diagnosis of a divergence: quantized elements that differ between two caches."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kivi import enable_kivi
from tools.check_generation import _generate, _quantized_differences


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
