"""Run configuration: YAML validated into typed objects before anything heavy is loaded.

Validation resolves every name (model spec, cache presets, workloads and their options) and checks that every
data source and the archive can be reached, so a bad config fails in a second with one message that names the
field, instead of after a model load on a GPU node. The gate checks its rules against a loaded config
(pipeline.gate.check_config_rules): it reads configs, so this module stays below it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from kivi import KiviConfig, KiviConfigError
from kivi.config import did_you_mean
from kivi.slot_cache import slot_unsupported
from pipeline.archive_root import ArchiveLocationError, open_root
from pipeline.errors import ConfigError, read_yaml, validation_problem, validation_text
from pipeline.models import RANDOM_PREFIX, ModelSpecError, check_model_spec
from pipeline.names import CANARY, FP16, NIGHTLY, RunKind
from pipeline.workloads import DataSourceError, UnknownWorkloadError, Workload, WorkloadOptionError, get_workload


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    spec: str = Field(description="packaged short name, random:<shape>, .gguf file, local folder or Hub id")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_context: PositiveInt = Field(2048, description="prompt + generation tokens per request")
    tokenizer: str | None = Field(None, description="tokenizer spec instead of the model's own: needed by random:<shape> "
                                  "models (e.g. smollm2-135m), or for a GGUF whose tokenizer transformers rebuilds wrongly")


class RaySection(_Section):
    address: str | None = Field(None, description="cluster address; None starts a local Ray (or joins RAY_ADDRESS)")
    num_actors: PositiveInt | None = Field(None, description="None: one per GPU, or one CPU actor without GPUs")
    cpus_per_actor: float | None = Field(None, gt=0, description="CPU actors only; None shares the cluster's CPUs")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each actor needs, e.g. "
                                        "{eval_slot: 1} where each worker node offers one: actors only there, one a node")
    shard_size: PositiveInt = Field(8, description="requests per shard (the unit of resume and retry)")
    max_retries: int = Field(2, ge=0, description="restarts of a dead actor, and retries of a job lost with one (its "
                             "process or node died) on the next free actor")


class GenerationSection(_Section):
    batch_size: PositiveInt = Field(4, description="requests generated together (left-padded)")


class SweepSection(_Section):
    """The throughput sweep over ShareGPT requests: batch sizes double from `start` until OOM or `max_batch`."""

    start: PositiveInt = 1
    max_batch: PositiveInt = 256
    max_new_tokens: PositiveInt | None = Field(None, description="cap on generated tokens per sequence")
    repeats: PositiveInt = Field(1, description="timings per point: with 2 or more the throughput ratio gets an interval")


class RunConfig(_Section):
    kind: RunKind = NIGHTLY
    model: ModelSection
    caches: tuple[str, ...] = Field(("kivi-2", "kivi-4"), description="KIVI presets compared with fp16")
    cache_overrides: dict[str, dict[str, Any]] = Field(default_factory=dict, description="preset -> KiviConfig fields")
    workloads: dict[str, dict[str, Any]]
    data_dir: Path | None = Field(None, description="local data copies; None reads the Hub (env KIVI_DATA_DIR)")
    archive: str = Field("archive", description="archive root: a folder, or a URI that every node reaches (s3://bucket/prefix, "
                         "gs://…, file://…), credentials and endpoint from the environment (AWS_*)")
    reports: Path = Field(Path("reports"), description="where reports/<run_id>/report.md is written")
    gate: Path | None = Field(None, description="gate rules YAML, relative to the config file")
    baseline_run_id: str | None = None
    ray: RaySection = RaySection()
    generation: GenerationSection = GenerationSection()
    sweep: SweepSection = SweepSection()

    @field_validator("workloads", mode="before")
    @classmethod
    def _no_options_means_defaults(cls, workloads: Any) -> Any:
        return {k: v or {} for k, v in workloads.items()} if isinstance(workloads, dict) else workloads

    @field_validator("archive", mode="before")
    @classmethod
    def _a_folder_as_text(cls, archive: Any) -> Any:
        return os.fspath(archive) if isinstance(archive, os.PathLike) else archive

    @field_validator("caches")
    @classmethod
    def _fp16_is_implicit(cls, caches: tuple[str, ...]) -> tuple[str, ...]:
        if FP16 in caches:
            raise ValueError(f"{FP16} is always run as the baseline; list only KIVI presets")
        if len(set(caches)) != len(caches):
            raise ValueError("a cache is listed twice")
        return caches

    def kivi_configs(self) -> dict[str, KiviConfig | None]:
        """Cache name (the archive's `cache` column) -> KIVI config; fp16 first, mapped to None."""
        out: dict[str, KiviConfig | None] = {FP16: None}
        for preset in self.caches:
            cfg = dataclasses.replace(KiviConfig.from_name(preset), **self.cache_overrides.get(preset, {}))
            out[cfg.name] = cfg
        return out

    def build_workloads(self) -> dict[str, Workload]:
        return {name: get_workload(name, data_dir=self.data_dir, **opts) for name, opts in self.workloads.items()}


def load_config(path: str | os.PathLike[str], **overrides: Any) -> RunConfig:
    """Read, validate and check a run config; every error is a ConfigError naming the field."""
    path = Path(path)
    raw = read_yaml(path, "config file", ConfigError) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    if raw.get("data_dir") is None:
        raw["data_dir"] = os.environ.get("KIVI_DATA_DIR")
    if raw.get("gate"):
        raw["gate"] = path.parent / raw["gate"] if not Path(raw["gate"]).is_absolute() else raw["gate"]
    try:
        config = RunConfig(**raw)
    except ValidationError as err:
        raise ConfigError(f"{path}: {validation_text(err, _config_problem)}") from None
    _check(config, path)
    return config


def _config_problem(error: dict[str, Any]) -> tuple[str, str]:
    where, message = validation_problem(error, RunConfig)
    return where or "config", message


def _check(config: RunConfig, path: Path) -> None:
    def fail(field: str, err: Exception) -> None:
        raise ConfigError(f"{path}: {field}: {err}") from None

    check_model_section(config.model, fail)
    kivi_fields = [f.name for f in dataclasses.fields(KiviConfig)]
    for preset, overrides in config.cache_overrides.items():
        if preset not in config.caches:
            hint = did_you_mean(preset, config.caches)
            fail(f"cache_overrides.{preset}", ValueError(f"not in caches {list(config.caches)}{hint}"))
        for name in overrides:
            if name not in kivi_fields:
                fail(f"cache_overrides.{preset}.{name}",
                     ValueError(f"not a KiviConfig field{did_you_mean(name, kivi_fields)}; fields: {', '.join(kivi_fields)}"))
    try:
        config.kivi_configs()
    except KiviConfigError as err:
        fail("caches", err)
    if config.data_dir is not None and not config.data_dir.is_dir():
        fail("data_dir", FileNotFoundError(f"no folder {config.data_dir}: point the config's top-level data_dir "
                                           "(or KIVI_DATA_DIR) at the local data copies, e.g. ../shared/data"))
    check_archive(config.archive, "archive", fail)
    if not config.workloads:
        fail("workloads", ValueError("name at least one workload"))
    sweeps = []
    for name, options in config.workloads.items():
        if "data_dir" in options:
            fail(f"workloads.{name}.data_dir", ValueError("data_dir is the config's top-level field (or KIVI_DATA_DIR), "
                                                          "shared by every workload"))
        try:
            workload = get_workload(name, data_dir=config.data_dir, **options)
            workload.check_data()
        except (UnknownWorkloadError, WorkloadOptionError, DataSourceError) as err:
            fail(f"workloads.{name}", err)
        if workload.kind == "throughput":
            sweeps.append(name)
    for cache, kivi in config.kivi_configs().items():
        if sweeps and kivi is not None and (reason := slot_unsupported(kivi)):
            fail("caches", ValueError(f"{cache} cannot run the {sweeps[0]} sweep on the static decode engine: {reason}"))
    if config.gate is not None and not config.gate.is_file():
        fail("gate", FileNotFoundError(f"no gate rules file {config.gate}"))
    if config.kind == CANARY and not config.baseline_run_id:
        fail("baseline_run_id", ValueError("a canary needs the baseline run to compare with"))


def check_model_section(model: ModelSection, fail: Callable[[str, Exception], None]) -> None:
    """``fail(field, error)`` for a model or tokenizer spec that cannot be resolved (no model loads)."""
    for field, spec in (("model.spec", model.spec), ("model.tokenizer", model.tokenizer)):
        if spec is not None:
            try:
                check_model_spec(spec)
            except ModelSpecError as err:
                fail(field, err)
    if model.spec.startswith(RANDOM_PREFIX) and model.tokenizer is None:
        fail("model.tokenizer", ValueError(f"{model.spec} has random weights and no tokenizer; set one, e.g. smollm2-135m"))


def check_archive(archive: str, field: str, fail: Callable[[str, Exception], None]) -> None:
    """``fail(field, error)`` unless the archive root resolves and its store answers."""
    try:
        open_root(archive).check()
    except ArchiveLocationError as err:
        fail(field, err)
