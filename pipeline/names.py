"""Names every stage shares (config, runner, archive, store, gate, report): spelt here once."""

from __future__ import annotations

from typing import Literal, get_args

FP16 = "fp16"  # the `cache` value of the unquantized baseline in every run

RunKind = Literal["smoke", "nightly", "canary"]
RUN_KINDS: tuple[str, ...] = get_args(RunKind)  # in the order messages list them
SMOKE, NIGHTLY, CANARY = RUN_KINDS
