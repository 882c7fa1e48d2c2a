"""The "kivi" attention's mask: transformers' own, except that a compiled forward keeps a plain causal prompt maskless."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig
from transformers.masking_utils import create_causal_mask

import kivi.integration  # noqa: F401 - registers the "kivi" attention and its mask


def _config(implementation: str) -> LlamaConfig:
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                         vocab_size=100)
    config._attn_implementation = implementation
    return config


def _mask(config, x, padding=None, past=0):
    cache = DynamicCache()
    if past:
        cache.update(torch.zeros(x.shape[0], 1, past, 32), torch.zeros(x.shape[0], 1, past, 32), 0)
    return create_causal_mask(config=config, inputs_embeds=x, attention_mask=padding, past_key_values=cache)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_plain_causal_prompt_has_no_mask_even_compiled_and_every_other_mask_is_transformers(compiled):
    """No mask: SDPA runs causal on its flash kernel. The stock "sdpa" mask, compiled, is materialized (why the
    "kivi" one exists); with padding or a past, the "kivi" mask is the stock one, compiled or not."""
    mask = torch.compile(_mask, dynamic=True) if compiled else _mask
    kivi_config, sdpa_config = _config("kivi"), _config("sdpa")
    x = torch.zeros(3, 7, 64)
    padding = torch.ones(3, 7, dtype=torch.long)
    padding[0, 5:] = 0
    assert mask(kivi_config, x) is None
    assert (mask(sdpa_config, x) is not None) == compiled
    for kwargs in ({"padding": padding}, {"past": 4}):
        got, stock = mask(kivi_config, x, **kwargs), _mask(sdpa_config, x, **kwargs)
        assert got is not None and torch.equal(got, stock), kwargs
