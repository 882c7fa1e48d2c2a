"""KIVI: tuning-free asymmetric 2-bit KV cache quantization (keys per channel, values per token)."""

import importlib

from kivi.config import KiviConfig, KiviConfigError

__all__ = ["KiviCache", "KiviConfig", "KiviConfigError", "enable_kivi"]

# The cache and its attention glue import torch and transformers; the config does not. Loading them on first
# use keeps `import kivi.config` (presets, names, did_you_mean) cheap for the CLI's archive commands.
_WITH_TORCH = {"KiviCache": "kivi.cache", "enable_kivi": "kivi.integration"}


def __getattr__(name: str):
    if name in _WITH_TORCH:
        return getattr(importlib.import_module(_WITH_TORCH[name]), name)
    raise AttributeError(f"module 'kivi' has no attribute {name!r}")
