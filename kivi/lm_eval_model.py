"""lm-eval's model "kivi": its HF model with a KIVI cache in every generation.

    lm-eval run --model kivi --model_args pretrained=FOLDER,k_bits=2,v_bits=2 --tasks gsm8k

Registered by kivi_lm_eval_hook (installed with this package), so lm-eval's own command line knows it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from lm_eval.models.huggingface import HFLM

from kivi.cache import KiviCache
from kivi.config import KiviConfig, KiviConfigError, did_you_mean
from kivi.integration import enable_kivi

KIVI_FIELDS = tuple(f.name for f in dataclasses.fields(KiviConfig))
HF_ARGS = frozenset(inspect.signature(HFLM.__init__).parameters)


class KiviLM(HFLM):
    """``--model hf`` with KIVI: every HF model argument works as there, plus the cache's.

    KIVI model args: the KiviConfig fields (k_bits, v_bits, group_size, residual_length, key_axis,
    value_axis, sink_tokens, layer_overrides such as ``layer_overrides={0:{'k_bits':4}}``) and
    ``kivi=<preset>`` (a KiviConfig.from_name preset, which fields given beside it override). They are
    validated before the weights load: a bad value raises KiviConfigError naming the field.

    Generation (generate_until tasks) runs with a fresh KiviCache per batch. Log-likelihood requests are
    one forward pass over the whole sequence with no cache to quantize, so KIVI leaves them unchanged.
    """

    def __init__(self, pretrained, kivi: str | None = None, **kwargs: Any) -> None:
        fields = {name: kwargs.pop(name) for name in KIVI_FIELDS if name in kwargs}
        for name in kwargs.keys() - HF_ARGS:  # the rest reach from_pretrained: a misspelt KIVI field fails there late
            if hint := did_you_mean(name, KIVI_FIELDS):
                raise KiviConfigError(f"model_args {name}={kwargs[name]!r}: no KIVI field and no HF argument{hint}")
        base = KiviConfig.from_name(kivi) if kivi is not None else KiviConfig()
        self.kivi_config = dataclasses.replace(base, **fields)
        super().__init__(pretrained, **kwargs)
        enable_kivi(self.model)
        KiviCache(self.model.config, self.kivi_config)  # fails now if the config does not fit the model

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = KiviCache(self.model.config, self.kivi_config)  # a cache holds one generation's sequences
        return super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)
