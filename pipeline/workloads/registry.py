"""Workloads by name: @register_workload("gsm8k") and get_workload("gsm8k", n=100)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kivi.config import did_you_mean
from pipeline.workloads.base import Workload

_WORKLOADS: dict[str, type[Workload]] = {}


class UnknownWorkloadError(ValueError):
    """No workload is registered under the requested name."""


def register_workload(name: str) -> Callable[[type[Workload]], type[Workload]]:
    def register(cls: type[Workload]) -> type[Workload]:
        if name in _WORKLOADS:
            raise ValueError(f"workload '{name}' is already registered by {_WORKLOADS[name].__qualname__}")
        cls.name = name
        _WORKLOADS[name] = cls
        return cls

    return register


def workload_names() -> list[str]:
    return sorted(_WORKLOADS)


def workload_class(name: str) -> type[Workload]:
    if name not in _WORKLOADS:
        raise UnknownWorkloadError(f"Unknown workload {name!r}{did_you_mean(name, _WORKLOADS)}. Known: {', '.join(workload_names())}")
    return _WORKLOADS[name]


def get_workload(name: str, **options: Any) -> Workload:
    """The workload registered as name, its options validated (WorkloadOptionError names the bad one)."""
    return workload_class(name)(**options)
