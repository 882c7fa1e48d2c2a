"""KIVI cache configuration: bit widths, group size G, residual length R, axes, sinks, per-layer overrides."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping

BIT_WIDTHS = (2, 4, 8, 16)  # 16 keeps the stream in the model dtype
AXES = ("channel", "token")
WORD_BITS = 32  # codes are packed into int32 words (see kivi.quant)
FP16 = "fp16"  # the name of the unquantized baseline beside the KIVI presets (results' `cache` column)


class KiviConfigError(ValueError):
    """A KIVI configuration value is invalid; the message names the field and the fix."""


@dataclass(frozen=True)
class KiviConfig:
    """How a KIVI cache stores keys and values.

    k_bits, v_bits: bits per code (2, 4, 8) or 16 to keep that stream unquantized.
    group_size: G elements share one scale and zero.
    residual_length: R newest tokens kept in full precision; R % G == 0. R = 0 quantizes as soon as
        possible: per-token streams at once, per-channel streams whenever a full group of G tokens exists.
    key_axis, value_axis: "channel" groups G consecutive tokens of one channel (KIVI's keys);
        "token" groups G consecutive channels of one token (KIVI's values).
    sink_tokens: the first N tokens of each sequence are never quantized (attention sinks, as KVQuant).
    layer_overrides: {layer_index: {field: value}} e.g. {0: {"k_bits": 4, "v_bits": 4}}.
    """

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    key_axis: str = "channel"
    value_axis: str = "token"
    sink_tokens: int = 0
    layer_overrides: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self)
        for layer, override in self.layer_overrides.items():
            where = f"KiviConfig.layer_overrides[{layer!r}]"
            if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
                raise KiviConfigError(f"{where}: layer index must be an int >= 0")
            if not isinstance(override, Mapping):
                raise KiviConfigError(f"{where} must be a mapping like {{'k_bits': 4}}, got {override!r}")
            allowed = {f.name for f in dataclasses.fields(self)} - {"layer_overrides", "sink_tokens"}
            for name in override:
                if name not in allowed:
                    raise KiviConfigError(f"{where}: unknown field {name!r}{did_you_mean(name, allowed)}")
            try:
                dataclasses.replace(self, layer_overrides={}, **override)
            except KiviConfigError as err:
                raise KiviConfigError(str(err).replace("KiviConfig", where, 1)) from None

    def for_layer(self, layer_idx: int) -> KiviConfig:
        """The configuration that applies to one layer (overrides merged, no overrides left)."""
        return dataclasses.replace(self, layer_overrides={}, **self.layer_overrides.get(layer_idx, {}))

    @cached_property  # read at every step of every layer
    def keys(self) -> StreamConfig:
        return StreamConfig(self.k_bits, self.group_size, self.residual_length, self.key_axis, self.sink_tokens)

    @cached_property
    def values(self) -> StreamConfig:
        return StreamConfig(self.v_bits, self.group_size, self.residual_length, self.value_axis, self.sink_tokens)

    @property
    def name(self) -> str:
        """Stable short name used as the `cache` column of results, e.g. ``kivi-k2v2-g32-r128``."""
        parts = [f"kivi-k{self.k_bits}v{self.v_bits}-g{self.group_size}-r{self.residual_length}"]
        if self.key_axis != "channel":
            parts.append(f"k{self.key_axis}")
        if self.value_axis != "token":
            parts.append(f"v{self.value_axis}")
        if self.sink_tokens:
            parts.append(f"s{self.sink_tokens}")
        for layer in sorted(self.layer_overrides):
            spec = "".join(f"{k[0]}{v}" if k.endswith("bits") else f"{k}{v}" for k, v in self.layer_overrides[layer].items())
            parts.append(f"L{layer}{spec}")
        return "-".join(parts)

    @classmethod
    def from_streams(cls, keys: StreamConfig, values: StreamConfig) -> KiviConfig:
        """The layer configuration of a key and a value stream."""
        shared = ("group_size", "residual_length", "sink_tokens")
        if any(getattr(keys, f) != getattr(values, f) for f in shared):
            raise KiviConfigError(f"key and value streams must share {', '.join(shared)}: {keys} vs {values}")
        return cls(k_bits=keys.bits, v_bits=values.bits, group_size=keys.group_size, residual_length=keys.residual_length,
                   key_axis=keys.axis, value_axis=values.axis, sink_tokens=keys.sink_tokens)

    @classmethod
    def from_name(cls, name: str) -> KiviConfig:
        """A named preset (see ``PRESETS``), or a preset's cache name as outputs print it (``kivi-k2v2-g32-r128``)."""
        if name in PRESETS:
            return cls(**PRESETS[name])
        if preset := cache_presets().get(name):
            return cls(**PRESETS[preset])
        raise KiviConfigError(f"unknown KIVI preset {name!r}{did_you_mean(name, PRESETS)}; presets: {', '.join(PRESETS)}")


@dataclass(frozen=True)
class StreamConfig:
    """One stream (the keys or the values) of a layer, and KIVI's flush rule for it, written here once.

    Grouped along tokens (``axis="channel"``, KIVI's keys), the residual flushes in blocks of ``block`` = R
    tokens (G when R = 0: a group needs G tokens). Grouped along channels (``axis="token"``, values), the
    residual is a window of the newest R tokens and every token that leaves it is quantized.
    """

    bits: int
    group_size: int
    residual_length: int
    axis: str
    sink_tokens: int = 0

    @property
    def quantizes(self) -> bool:
        return self.bits < 16

    @property
    def block(self) -> int:
        """Tokens a per-channel stream quantizes at once."""
        return self.residual_length or self.group_size

    @property
    def window(self) -> int:
        """Newest tokens a per-token stream keeps in full precision."""
        return self.residual_length

    def quantized(self, tokens):
        """How many of ``tokens`` stored tokens (after the sinks; an int or an integer tensor) sit quantized once
        the flush rule has run; on a residual of ``tokens``, how many of them the flush quantizes."""
        if self.axis == "channel":
            return tokens // self.block * self.block
        over = tokens - self.window
        return over.clamp(min=0) if hasattr(over, "clamp") else max(over, 0)


PRESETS: dict[str, dict[str, Any]] = {
    "kivi-2": dict(k_bits=2, v_bits=2),
    "kivi-4": dict(k_bits=4, v_bits=4),
    "kivi-8": dict(k_bits=8, v_bits=8),
    "kivi-2-r32": dict(k_bits=2, v_bits=2, residual_length=32),
    "kivi-2-r0": dict(k_bits=2, v_bits=2, residual_length=0),
    # Paper Table 1 ablation: keys grouped per token like values (what KIVI shows to fail at 2 bits).
    "token-keys-2": dict(k_bits=2, v_bits=2, key_axis="token"),
    "token-keys-2-r0": dict(k_bits=2, v_bits=2, key_axis="token", residual_length=0),
    "unquantized": dict(k_bits=16, v_bits=16),
}


def preset_caches() -> dict[str, str]:
    """Each preset's cache name, as results' `cache` column spells it: {"kivi-2": "kivi-k2v2-g32-r128", …}."""
    return {preset: KiviConfig.from_name(preset).name for preset in PRESETS}


def cache_presets() -> dict[str, str]:
    """Each cache name's preset, the inverse of ``preset_caches``: {"kivi-k2v2-g32-r128": "kivi-2", …}."""
    return {cache: preset for preset, cache in preset_caches().items()}


def cache_name(name: str) -> str:
    """The archive's name of a cache named by its preset (``kivi-2`` → ``kivi-k2v2-g32-r128``) or by itself."""
    return preset_caches().get(name, name)


def slot_unsupported(config: KiviConfig) -> str | None:
    """Why kivi.slot_cache.SlotCache, the static decode engine's cache, cannot hold this configuration (None when it
    can); decided from the configuration alone, so that a run config is checked without torch."""
    for i, layer in [(None, config)] + [(i, config.for_layer(i)) for i in config.layer_overrides]:
        where = "" if i is None else f" (layer_overrides[{i}])"
        if layer.sink_tokens:
            return f"sink_tokens={layer.sink_tokens}: the static decode engine keeps no sink buffers; set sink_tokens: 0{where}"
        if 16 in (layer.k_bits, layer.v_bits):
            return f"k_bits/v_bits=16: the static decode engine quantizes both streams; use 2, 4 or 8{where}"
        if (layer.key_axis, layer.value_axis) != ("channel", "token"):
            return f"key_axis/value_axis must be KIVI's 'channel'/'token' for the static decode engine{where}"
        if layer.group_size & (layer.group_size - 1):
            return f"group_size={layer.group_size}: the static decode engine's kernels need a power of two{where}"
    return None


def _validate(cfg: KiviConfig) -> None:
    prefix = "KiviConfig"
    for name in ("k_bits", "v_bits"):
        bits = getattr(cfg, name)
        if bits not in BIT_WIDTHS:
            raise KiviConfigError(f"{prefix}.{name}={bits!r} is not supported; use one of {BIT_WIDTHS}")
    for name in ("key_axis", "value_axis"):
        axis = getattr(cfg, name)
        if axis not in AXES:
            raise KiviConfigError(f"{prefix}.{name}={axis!r}{did_you_mean(axis, AXES)}; use one of {AXES}")
    g, r = cfg.group_size, cfg.residual_length
    # A group must fill whole int32 words at the narrowest width (16 two-bit codes per word).
    if not isinstance(g, int) or g <= 0 or g % 16:
        raise KiviConfigError(f"{prefix}.group_size={g!r} must be a positive multiple of 16 (e.g. 32)")
    if not isinstance(r, int) or r < 0 or r % g:
        fix = f"use {r // g * g} or {(r // g + 1) * g}" if isinstance(r, int) and r > 0 else "use 0, 32, 128 …"
        raise KiviConfigError(f"{prefix}.residual_length={r!r} must be >= 0 and a multiple of group_size={g}; {fix}")
    if not isinstance(cfg.sink_tokens, int) or cfg.sink_tokens < 0:
        raise KiviConfigError(f"{prefix}.sink_tokens={cfg.sink_tokens!r} must be an int >= 0")


def did_you_mean(name: Any, choices: Iterable[Any], n: int = 1) -> str:
    """' (did you mean 'x'?)' naming the up to n choices closest to name, or '' when none is close.

    The one spelling suggestion of every name this project reads (presets, config keys, workloads, gate
    rules, model specs, run ids); kivi is the lowest layer, so pipeline/ imports it from here.
    """
    close = [repr(c) for c in difflib.get_close_matches(str(name), [str(c) for c in choices], n=n)]
    if not close:
        return ""
    names = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
    return f" (did you mean {names}?)"
