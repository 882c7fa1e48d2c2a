"""Names every stage shares (config, runner, archive, store, gate, report): spelt here once."""

from __future__ import annotations

from typing import Literal, get_args

from kivi.config import FP16  # the baseline's `cache` value, named where kivi names caches

__all__ = ["FP16", "RunKind", "RUN_KINDS", "SMOKE", "NIGHTLY", "CANARY"]

RunKind = Literal["smoke", "nightly", "canary"]
RUN_KINDS: tuple[str, ...] = get_args(RunKind)  # in the order messages list them
SMOKE, NIGHTLY, CANARY = RUN_KINDS
