"""Run configuration: YAML validated into typed objects before anything heavy is loaded.

Validation resolves every name (model spec, cache presets, workloads and their options) and checks that every
data source and the archive can be reached, so a bad config fails in a second, before any model loads, with one
message that names every bad field and its fix. It imports neither torch nor transformers (the model specs
come from pipeline.model_specs). The gate checks its rules against a loaded config
(pipeline.gate.check_config_rules): it reads configs, so this module stays below it.

Relative paths in a config (data_dir, archive, reports, gate) are read from the working directory, as the
command line's are: a config copied anywhere runs the same from the checkout, and its archive is the one the
archive commands read (./archive).
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kivi import KiviConfig, KiviConfigError
from kivi.config import did_you_mean, slot_unsupported
from pipeline.archive_root import open_root
from pipeline.errors import ConfigError, FieldProblems, read_yaml, validation_problem, validation_problems
from pipeline.model_specs import RANDOM_PREFIX, check_model_spec
from pipeline.names import CANARY, FP16, NIGHTLY, RUN_KINDS, RunKind
from pipeline.workloads import (
    DataSourceError,
    UnknownWorkloadError,
    Workload,
    WorkloadOptionError,
    get_workload,
    resolve_data_dir,
    workload_class,
)

LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # it starts the run ids, which name archive folders


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    spec: str = Field(description="packaged short name, random:<shape>, .gguf file, local folder or Hub id")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_context: PositiveInt = Field(2048, description="prompt + generation tokens per request")
    tokenizer: str | None = Field(None, validate_default=True,
                                  description="tokenizer spec instead of the model's own: needed by random:<shape> "
                                  "models (e.g. smollm2-135m), or for a GGUF whose tokenizer transformers rebuilds wrongly")
    compile_prefill: bool = Field(False, description="run the prompts' forward under torch.compile: on an H100 a 7B "
                                  "model's ShareGPT prefill took 24% less time, for about a minute of compile per "
                                  "worker (BENCHMARKS.md, \"The prefill compiled\")")

    @field_validator("spec")
    @classmethod
    def _known_spec(cls, spec: str) -> str:
        check_model_spec(spec)
        return spec

    @field_validator("tokenizer")
    @classmethod
    def _a_tokenizer_where_the_model_has_none(cls, tokenizer: str | None, info: ValidationInfo) -> str | None:
        if tokenizer is not None:
            check_model_spec(tokenizer)
        elif info.data.get("spec", "").startswith(RANDOM_PREFIX):
            raise ValueError(f"{info.data['spec']} has random weights and no tokenizer; set one, e.g. smollm2-135m")
        return tokenizer


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
    """A run. Fields are validated in this order, and a field's check reads the fields before it (`info.data`):
    each is checked on its own, so one message names every bad field."""

    kind: RunKind = Field(NIGHTLY, description="what the run is: a canary is gated against a baseline run")
    label: str = Field(default_factory=lambda data: data.get("kind", NIGHTLY), pattern=LABEL_PATTERN,
                       description="the series the run belongs to: its run ids start with it, and `runs`, `history` "
                       "and the report's history tell series apart by it; default: the kind")
    model: ModelSection
    data_dir: Path | None = Field(None, validate_default=True,
                                  description="local data copies; unset: KIVI_DATA_DIR, else ../shared/data beside the "
                                  "checkout where it exists, else the Hub ('hub' picks the Hub: None once resolved)")
    workloads: dict[str, dict[str, Any]]
    caches: tuple[str, ...] = Field(("kivi-2", "kivi-4"), description="KIVI presets compared with fp16")
    cache_overrides: dict[str, dict[str, Any]] = Field(default_factory=dict, description="preset -> KiviConfig fields")
    archive: str = Field("archive", description="archive root: a folder, or a URI that every node reaches (s3://bucket/prefix, "
                         "gs://…, file://…), credentials and endpoint from the environment (AWS_*)")
    reports: Path = Field(Path("reports"), description="where reports/<run_id>/report.md is written")
    gate: Path | None = Field(None, description="gate rules YAML, e.g. configs/gates/smoke.yaml")
    baseline_run_id: str | None = Field(None, validate_default=True, description="the run a canary is compared with")
    ray: RaySection = RaySection()
    generation: GenerationSection = GenerationSection()
    sweep: SweepSection = SweepSection()

    @field_validator("data_dir", mode="before")
    @classmethod
    def _resolved(cls, data_dir: Any) -> Any:
        return resolve_data_dir(data_dir)

    @field_validator("data_dir")
    @classmethod
    def _a_folder(cls, data_dir: Path | None) -> Path | None:
        if data_dir is not None and not data_dir.is_dir():
            raise ValueError(f"no folder {data_dir}: point the config's top-level data_dir (or KIVI_DATA_DIR) at the "
                             "local data copies, e.g. ../shared/data")
        return data_dir

    @field_validator("workloads", mode="before")
    @classmethod
    def _no_options_means_defaults(cls, workloads: Any) -> Any:
        return {k: v or {} for k, v in workloads.items()} if isinstance(workloads, dict) else workloads

    @field_validator("workloads")
    @classmethod
    def _known_workloads_with_their_data(cls, workloads: dict[str, dict[str, Any]],
                                         info: ValidationInfo) -> dict[str, dict[str, Any]]:
        if not workloads:
            raise ValueError("name at least one workload")
        problems = []
        for name, options in workloads.items():
            if "data_dir" in options:
                problems.append((f"{name}.data_dir", "data_dir is the config's top-level field (or KIVI_DATA_DIR), "
                                                     "shared by every workload"))
                continue
            try:
                workload = get_workload(name, data_dir=info.data.get("data_dir"), **options)
                if "data_dir" in info.data:  # a bad data_dir is its own error, once
                    workload.check_data()
            except (UnknownWorkloadError, WorkloadOptionError, DataSourceError) as err:
                problems.append((name, str(err)))
        if problems:
            raise FieldProblems(problems)
        return workloads

    @field_validator("caches")
    @classmethod
    def _presets(cls, caches: tuple[str, ...]) -> tuple[str, ...]:
        if FP16 in caches:
            raise ValueError(f"{FP16} is always run as the baseline; list only KIVI presets")
        if len(set(caches)) != len(caches):
            raise ValueError("a cache is listed twice")
        problems = []
        for preset in caches:
            try:
                KiviConfig.from_name(preset)
            except KiviConfigError as err:
                problems.append(str(err))
        if problems:
            raise ValueError("; ".join(problems))
        return caches

    @field_validator("cache_overrides")
    @classmethod
    def _overrides_of_listed_presets(cls, overrides: dict[str, dict[str, Any]],
                                     info: ValidationInfo) -> dict[str, dict[str, Any]]:
        caches = info.data.get("caches")
        fields = [f.name for f in dataclasses.fields(KiviConfig)]
        problems = []
        for preset, values in overrides.items():
            if caches is not None and preset not in caches:
                problems.append((preset, f"not in caches {list(caches)}{did_you_mean(preset, caches)}"))
                continue
            unknown = [(f"{preset}.{name}", f"not a KiviConfig field{did_you_mean(name, fields)}; fields: {', '.join(fields)}")
                       for name in values if name not in fields]
            problems += unknown
            if not unknown and preset in (caches or ()):
                try:
                    dataclasses.replace(KiviConfig.from_name(preset), **values)
                except KiviConfigError as err:
                    problems.append((preset, str(err)))
        if problems:
            raise FieldProblems(problems)
        return overrides

    @field_validator("archive", mode="before")
    @classmethod
    def _a_folder_as_text(cls, archive: Any) -> Any:
        return os.fspath(archive) if isinstance(archive, os.PathLike) else archive

    @field_validator("archive")
    @classmethod
    def _reachable(cls, archive: str) -> str:
        open_root(archive).check()
        return archive

    @field_validator("gate")
    @classmethod
    def _a_rules_file(cls, gate: Path | None, info: ValidationInfo) -> Path | None:
        if gate is None or gate.is_file():
            return gate
        beside = Path((info.context or {}).get("config_path", ".")).parent / gate  # where configs once read it from
        hint = (f"; {beside} is the file beside the config: write gate: {beside}" if beside.is_file() and not gate.is_absolute()
                else "")
        raise ValueError(f"no gate rules file {gate} (a relative path is read from the working directory, "
                         f"{Path.cwd()}){hint}")

    @field_validator("baseline_run_id")
    @classmethod
    def _a_canary_has_one(cls, baseline: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("kind") == CANARY and not baseline:
            raise ValueError("a canary needs the baseline run to compare with")
        return baseline

    @model_validator(mode="after")
    def _sweeps_on_the_static_engine(self) -> RunConfig:
        sweeps = [name for name in self.workloads if workload_class(name).kind == "throughput"]
        for cache, kivi in self.kivi_configs().items():
            if sweeps and kivi is not None and (reason := slot_unsupported(kivi)):
                raise FieldProblems([("caches", f"{cache} cannot run the {sweeps[0]} sweep on the static decode "
                                                f"engine: {reason}")])
        return self

    def kivi_configs(self) -> dict[str, KiviConfig | None]:
        """Cache name (the archive's `cache` column) -> KIVI config; fp16 first, mapped to None."""
        out: dict[str, KiviConfig | None] = {FP16: None}
        for preset in self.caches:
            cfg = dataclasses.replace(KiviConfig.from_name(preset), **self.cache_overrides.get(preset, {}))
            out[cfg.name] = cfg
        return out

    def build_workloads(self) -> dict[str, Workload]:
        return {name: get_workload(name, data_dir=self.data_dir, **opts) for name, opts in self.workloads.items()}


def config_kind(path: str | os.PathLike[str]) -> str | None:
    """The kind a config file declares (None: not given), read before it is validated as a run or as a generate
    config. A kind of neither is the one error: the kind picks the fields that the rest is checked against."""
    raw = read_yaml(Path(path), "config file", ConfigError)
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if kind is not None and kind not in RUN_KINDS:
        raise ConfigError(f"{path}: kind: {kind!r} is none of {', '.join(RUN_KINDS)}"
                          f"{did_you_mean(str(kind), RUN_KINDS)}")
    return kind


def load_config(path: str | os.PathLike[str], **overrides: Any) -> RunConfig:
    """Read, validate and check a run config; any problem raises one ConfigError naming every bad field."""
    path = Path(path)
    raw = read_yaml(path, "config file", ConfigError) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RunConfig.model_validate(raw, context={"config_path": path})
    except ValidationError as err:
        problems = validation_problems(err, partial(validation_problem, model=RunConfig))
    if len(problems) == 1:
        raise ConfigError(f"{path}: {_line(*problems[0])}")
    raise ConfigError(f"{path}: {len(problems)} problems:\n" + "\n".join(f"  {_line(*p)}" for p in problems))


def _line(where: str, message: str) -> str:
    return f"{where}: {message}" if where else message
