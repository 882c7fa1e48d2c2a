"""KIVI: tuning-free asymmetric 2-bit KV cache quantization (keys per channel, values per token)."""

from kivi.cache import KiviCache
from kivi.config import KiviConfig, KiviConfigError
from kivi.integration import enable_kivi

__all__ = ["KiviCache", "KiviConfig", "KiviConfigError", "enable_kivi"]
