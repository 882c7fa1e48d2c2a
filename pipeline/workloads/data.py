"""Where workload data comes from: a local copy under data_dir, or the Hugging Face Hub."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError

T = TypeVar("T")

HUB = "hub"  # a data_dir (or KIVI_DATA_DIR) of this word reads the Hub even where a local copy exists
# The offline copies beside a checkout, as CI and the shared data folder lay them out (../shared/data).
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"
DATA_DIR_ORDER = ("the config's data_dir, else $KIVI_DATA_DIR, else ../shared/data beside the checkout where it "
                  f"exists, else the Hugging Face Hub ({HUB!r} in either picks the Hub)")


class DataSourceError(RuntimeError):
    """The data of a workload cannot be read: a missing folder or file, or an unreachable Hub."""


def resolve_data_dir(value: str | os.PathLike[str] | None) -> Path | None:
    """The data folder a run reads, in the order of DATA_DIR_ORDER (``value``: the config's data_dir); None: the Hub."""
    if value is None:
        value = os.environ.get("KIVI_DATA_DIR") or None
    if value is None:
        return DEFAULT_DATA_DIR if DEFAULT_DATA_DIR.is_dir() else None
    return None if os.fspath(value) == HUB else Path(value)


def local_path(data_dir: Path, *parts: str) -> Path:
    """data_dir/parts…, failing with the first path that does not exist."""
    if not data_dir.is_dir():
        raise DataSourceError(f"data folder {data_dir} does not exist (data_dir)")
    path = data_dir.joinpath(*parts)
    if not path.exists():
        raise DataSourceError(f"{path} does not exist (expected under data_dir {data_dir})")
    return path


def require_hub(repo_id: str) -> None:
    """Fail early, before any model loads, when the Hub cannot serve repo_id."""
    hint = f"point data_dir at a local copy of the data sets (a run reads {DATA_DIR_ORDER})"
    if constants.HF_HUB_OFFLINE:
        raise DataSourceError(f"HF_HUB_OFFLINE is set, so dataset '{repo_id}' cannot be read from the Hub: {hint}")
    try:
        HfApi().dataset_info(repo_id, timeout=10)
    except (OSError, httpx.HTTPError, HfHubHTTPError) as error:
        raise DataSourceError(
            f"cannot reach dataset '{repo_id}' on the Hugging Face Hub ({error}): {hint}, "
            "or fix the network (and leave HF_HUB_OFFLINE unset)"
        ) from None


def read_lines(path: Path) -> list[str]:
    # Not splitlines(): raw U+2028 or U+0085 may sit inside JSON strings and must not split a record.
    return path.read_text(encoding="utf-8").split("\n")


def hub_file(repo_id: str, filename: str) -> Path:
    """A file of a Hub dataset repo, downloaded once into the Hugging Face cache."""
    require_hub(repo_id)
    return Path(hf_hub_download(repo_id=repo_id, filename=filename, repo_type="dataset"))


def parse_records(
    rows: Iterable[str | Mapping[str, Any]],
    required: Mapping[str, type | tuple[type, ...]],
    skipped: Counter[str],
    label: str,
) -> list[tuple[int, dict[str, Any]]]:
    """(row index, record) for each row that is a JSON object with the required fields and types.

    Rows are JSON lines or already-decoded dicts; blank lines are ignored, anything else that is
    unusable is counted in skipped under "<label>: <reason>" instead of failing the whole run.
    """
    records = []
    for index, row in enumerate(rows):
        if isinstance(row, str):
            if not row.strip():
                continue
            try:
                row = json.loads(row)
            except json.JSONDecodeError:
                skipped[f"{label}: invalid JSON"] += 1
                continue
        if not isinstance(row, Mapping):
            skipped[f"{label}: not a JSON object"] += 1
            continue
        problems = (_field_problem(row, name, kind) for name, kind in required.items())
        problem = next((p for p in problems if p), None)
        if problem:
            skipped[f"{label}: {problem}"] += 1
            continue
        records.append((index, dict(row)))
    return records


def _field_problem(row: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> str | None:
    if name not in row or row[name] is None:
        return f"missing field '{name}'"
    if not isinstance(row[name], kind):
        return f"field '{name}' is {type(row[name]).__name__}"
    return None


def sample(items: Sequence[T], n: int | None, seed: int) -> list[T]:
    """n items chosen with seed, kept in data order (all of them when n is None or larger)."""
    if n is None or n >= len(items):
        return list(items)
    chosen = sorted(random.Random(seed).sample(range(len(items)), n))
    return [items[i] for i in chosen]
