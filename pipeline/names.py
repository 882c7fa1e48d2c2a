"""Names every stage shares (config, runner, archive, store, gate, report): spelt here once."""

from __future__ import annotations

from typing import Literal, get_args

from kivi.config import FP16  # the baseline's `cache` value, named where kivi names caches

__all__ = ["FP16", "RunKind", "RUN_KINDS", "SMOKE", "NIGHTLY", "CANARY", "GENERATE"]

RunKind = Literal["smoke", "nightly", "canary"]  # an evaluation run's
SMOKE, NIGHTLY, CANARY = get_args(RunKind)
GENERATE = "generate"  # a kivi-eval generate run's kind (its config's `kind` too)
RUN_KINDS: tuple[str, ...] = (*get_args(RunKind), GENERATE)  # in the order messages list them
