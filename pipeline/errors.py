"""Bad input: the base class of every error the CLI answers in one line, and pydantic errors worded for people."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kivi.config import did_you_mean

if TYPE_CHECKING:
    from pydantic import ValidationError


class InputError(ValueError):
    """A config, rules file, model spec, run id, archive or query that cannot be used; the message says the fix.

    `kivi-eval` prints it as one line, ``kivi-eval: error: …``, and exits 2.
    """


class ConfigError(InputError):
    """The run config is invalid; the message names the file, the field and the fix."""


def read_yaml(path: Path, what: str, error: type[InputError]) -> Any:
    """The YAML document in ``path`` (a ``what``: "config file" …); a missing file or bad YAML raises ``error``."""
    if not path.is_file():
        raise error(f"{path}: no such {what}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise error(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None


class FieldProblems(ValueError):
    """Several problems inside one field, each at its own place below it (``("gsm8", "unknown workload …")``): a
    validator raises it so that pydantic reports them beside every other field's errors, each where it is."""

    def __init__(self, problems: Iterable[tuple[str, str]]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(f"{where}: {message}" for where, message in self.problems))


def validation_problems(error: ValidationError,
                        describe: Callable[[Mapping[str, Any]], tuple[str, str]]) -> list[tuple[str, str]]:
    """(where, message) of each problem of a pydantic error as ``describe`` places and words it; a field's
    FieldProblems count one each, placed below the field."""
    out = []
    for problem in error.errors():
        if problem["type"] == "default_factory_not_called":  # a default read from a field that failed: said there
            continue
        where, message = describe(problem)
        inner = problem.get("ctx", {}).get("error")
        if isinstance(inner, FieldProblems):
            out += [(".".join(p for p in (where, below) if p), text) for below, text in inner.problems]
        else:
            out.append((where, message))
    return out


def validation_text(error: ValidationError, describe: Callable[[Mapping[str, Any]], tuple[str, str]]) -> str:
    """A pydantic error in one line: its problems (``validation_problems``) as "<where>: <message>" (the message
    alone where there is no place), joined by "; "."""
    return "; ".join(f"{where}: {message}" if where else message for where, message in validation_problems(error, describe))


def validation_problem(error: Mapping[str, Any], model: Any) -> tuple[str, str]:
    """(where, message) of one pydantic error of ``model``; an unknown field or choice names the closest valid one."""
    loc = error["loc"]
    message = error_message(error)
    if error["type"] == "extra_forbidden" and (fields := _fields_at(model, loc[:-1])) is not None:
        message = unknown_field(loc[-1], fields)
    elif error["type"] == "literal_error":
        message += did_you_mean(error["input"], re.findall(r"'([^']*)'", error["ctx"]["expected"]))
    return ".".join(map(str, loc)), message


def error_message(error: Mapping[str, Any]) -> str:
    """Pydantic's message, without the "Value error, " it puts before a validator's own."""
    return error["msg"].removeprefix("Value error, ")


def unknown_field(name: Any, fields: Iterable[Any]) -> str:
    return f"unknown field{did_you_mean(name, fields)}"


def _fields_at(model: Any, loc: tuple) -> dict[str, Any] | None:
    """The fields of the section at ``loc`` inside ``model`` (None where loc leaves the nested models)."""
    for key in loc:
        field = getattr(model, "model_fields", {}).get(key)
        if field is None:
            return None
        model = field.annotation
    return getattr(model, "model_fields", None)
