"""The `generate` config kind: a generation run's options, from a YAML file (``kind: generate``), the command's flags
or both (flags win), validated before any model loads: a bad option is one ConfigError naming the field (and its
flag) and the fix. The model's weights are never read here; its config is, to know which caches the decode engine
serves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PositiveInt, ValidationError, field_validator

from kivi import KiviConfig, KiviConfigError
from pipeline.archive_root import ArchiveLocationError, open_root
from pipeline.config import ModelSection, RaySection, _Section
from pipeline.errors import ConfigError, read_yaml, validation_problem, validation_text
from pipeline.generation import openai
from pipeline.generation.cli import FLAGS
from pipeline.generation.rows import Options
from pipeline.generation.source import SourceError, columns, resolve, sample_records
from pipeline.names import FP16, GENERATE

# What decides a run's shards and outputs: a resume under other values would mix two runs' rows (the slots per
# actor and where it runs may change: outputs do not depend on them).
RESUME_FIELDS = ("input", "input_format", "split", "prompt_column", "messages_column", "id_column", "chat", "model",
                 "caches", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "score_kl",
                 "ray.shard_size")


class GenerateModel(ModelSection):
    max_context: PositiveInt | None = Field(None, description="prompt + new tokens per row; default the model's own "
                                                              "context (max_position_embeddings)")


class GenerateRay(RaySection):
    shard_size: PositiveInt = Field(256, description="input rows per shard (the unit of resume and retry)")


class GenerateConfig(_Section):
    """A generation run; each field's flag and meaning: ``pipeline.generation.cli.FLAGS``."""

    kind: Literal["generate"] = GENERATE
    input: str
    output: str
    model: GenerateModel
    caches: tuple[str, ...] = (FP16,)
    input_format: Literal["auto", "columns", "openai"] = "auto"
    split: str = "train"
    prompt_column: str = "prompt"
    messages_column: str | None = None
    id_column: str = "id"
    chat: bool = False
    max_new_tokens: PositiveInt = 256
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int = 0
    stop: tuple[str, ...] = ()
    score_kl: bool = False
    batch_size: PositiveInt = 32
    ray: GenerateRay = GenerateRay()
    reports: Path = Path("reports")
    gate: Path | None = None

    @field_validator("caches")
    @classmethod
    def _known_and_once(cls, caches: tuple[str, ...]) -> tuple[str, ...]:
        if not caches:
            raise ValueError("name at least one cache: fp16 or a KIVI preset (kivi-2 …)")
        names = [name if name == FP16 else KiviConfig.from_name(name).name for name in caches]
        if len(set(names)) != len(names):
            raise ValueError("a cache is listed twice")
        return caches

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in stop):
            raise ValueError("an empty stop string would end every row at once")
        return stop

    @property
    def archive(self) -> str:  # the name the shared worker and runner read
        return self.output

    def kivi_configs(self) -> dict[str, KiviConfig | None]:
        """Cache name (the archive's `cache` column) -> KIVI config, in the order given; fp16 maps to None."""
        configs = {name: None if name == FP16 else KiviConfig.from_name(name) for name in self.caches}
        return {FP16 if kivi is None else kivi.name: kivi for kivi in configs.values()}

    def options(self) -> Options:
        return Options(self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.seed, self.stop)

    def as_yaml(self) -> str:
        """Every field, defaults included: what the manifest keeps and a resume is compared with."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_generate_config(path: str | os.PathLike[str] | None = None, **flags: Any) -> GenerateConfig:
    """The config of a YAML file (if any) with ``flags`` (dotted field -> value, None: not given) over it, validated
    and checked; every problem is a ConfigError naming the field, its flag and the fix."""
    where = str(path) if path else "kivi-eval generate"
    raw = read_yaml(Path(path), "config file", ConfigError) or {} if path else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping")
    for dotted, value in flags.items():
        if value is not None:
            *sections, name = dotted.split(".")
            node = raw
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = value
    try:
        config = GenerateConfig(**raw)
    except ValidationError as err:
        raise ConfigError(f"{where}: {validation_text(err, _problem)}") from None
    except KiviConfigError as err:  # a cache name, from its validator
        raise ConfigError(f"{where}: {_named('caches')}: {err}") from None
    _check(config, where)
    return config


def _problem(error: dict[str, Any]) -> tuple[str, str]:
    where, message = validation_problem(error, GenerateConfig)
    if where == "model" and error["type"] == "missing":  # the section is required for its spec, which --model gives
        where = "model.spec"
    return _named(where or "config"), message


def _named(field: str) -> str:
    return f"{field} ({FLAGS[field][0]})" if field in FLAGS else field


def _check(config: GenerateConfig, where: str) -> None:
    def fail(field: str, err: Exception) -> None:
        raise ConfigError(f"{where}: {_named(field)}: {err}") from None

    try:
        open_root(config.output).check()
    except ArchiveLocationError as err:
        fail("output", err)
    if config.gate is not None:
        _check_rules(config, fail)
    if config.score_kl and all(kivi is None for kivi in config.kivi_configs().values()):
        fail("score_kl", ValueError("it scores KIVI outputs under fp16: add a KIVI cache (--cache kivi-2)"))
    try:
        source = resolve(config.input, config.split)
        records, known = sample_records(source), columns(source)
    except SourceError as err:
        fail("input", err)
    if record_format(config, records) == "openai":
        given = [f for f in ("prompt_column", "messages_column", "id_column", "chat")
                 if getattr(config, f) != GenerateConfig.model_fields[f].default]
        if given:
            fail(given[0], ValueError("the input is in the OpenAI batch format, whose lines name their own id "
                                      "(custom_id) and messages (body.messages): drop it"))
        return
    if config.messages_column and config.chat:
        fail("chat", ValueError("messages always go into the chat template; --chat is for a prompt column"))
    for field in ("id_column", "messages_column" if config.messages_column else "prompt_column"):
        name = getattr(config, field)
        present = name in known if known is not None else any(name in r for r in records)
        if not present:
            seen = known if known is not None else sorted({k for r in records for k in r})
            fail(field, ValueError(f"the input has no {name!r} (" + ("columns" if known is not None else
                                   f"fields of its first {len(records)} records") + f": {', '.join(seen) or 'none'})"))


def _check_rules(config: GenerateConfig, fail) -> None:
    """The rules file loads, and every rule reads generations of caches the run has."""
    from pipeline.gate import GateConfigError, load_gate

    try:
        rules = load_gate(config.gate).rules
    except GateConfigError as err:
        fail("gate", err)
    caches = [c for c in config.kivi_configs() if c != FP16]
    problems = [problem for rule in rules for problem in (
        rule.problems({}, caches) + _greedy_fp16_problems(rule.name, rule.kind, config) if "generations" in rule.reads
        else [f"rule {rule.name!r}: {rule.kind} reads evaluation results, and a generate run has generations: use "
              "min_exact_match"])]
    if problems:
        fail("gate", ValueError("; ".join(problems)))


def _greedy_fp16_problems(name: str, kind: str, config: GenerateConfig) -> list[str]:
    """A generations rule compares KIVI's greedy rows with fp16's: without fp16, or sampling every row, it has none."""
    out = []
    if FP16 not in config.caches:
        out.append(f"rule {name!r}: {kind} compares each KIVI cache's greedy outputs with fp16's, and the run has no "
                   f"fp16: add {FLAGS['caches'][0]} {FP16}")
    if config.temperature > 0:
        out.append(f"rule {name!r}: {kind} reads the rows generated greedily, and temperature {config.temperature:g} "
                   f"samples every row: gate a greedy run ({FLAGS['temperature'][0]} 0)")
    return out


def record_format(config: GenerateConfig, records: list[dict[str, Any]]) -> Literal["columns", "openai"]:
    """How the input's records are read: ``input_format``, or for auto, openai where the first record is a batch line."""
    if config.input_format != "auto":
        return config.input_format
    return "openai" if records and openai.is_batch_line(records[0]) else "columns"


def check_fallback_sampling(config: GenerateConfig, fallbacks: dict[str, str]) -> None:
    """Refuse sampling on a cache that generates with transformers.generate: its draws depend on the batch."""
    if config.temperature > 0 and fallbacks:
        cache, reason = next(iter(fallbacks.items()))
        raise ConfigError(f"kivi-eval generate: {_named('temperature')}: {cache} generates with transformers.generate "
                          f"({reason}), where sampling is not reproducible; sample with caches the decode engine "
                          "holds, or generate greedily (temperature 0)")
