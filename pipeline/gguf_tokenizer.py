"""Does transformers' tokenizer for a GGUF file tokenize as the file itself says? Checked from its metadata.

transformers rebuilds a GGUF's tokenizer from the vocabulary stored in the file (tokens, merges or scores,
special ids), and for some files it gets this wrong without a word: a SentencePiece vocabulary split into
single letters, no BOS where the file asks for one. Every cache then generates from garbage and the run
scores it as a real result. So before a GGUF model is used, its tokenizer is compared with the file's own
metadata (``problems``):

- BOS and EOS ids equal the file's (``tokenizer.ggml.bos_token_id`` / ``eos_token_id``);
- a probe text survives encode → decode;
- the probe's ids equal the file's own tokenization of it, as llama.cpp tokenizes that vocabulary: BPE
  merges applied by rank (``gpt2`` vocabularies), or SentencePiece pieces merged by score (``llama``);
- BOS is prepended when the file's ``add_bos_token`` says so (a warning: the engine feeds prompts without
  special tokens, lm-eval's default, but a user of the tokenizer would be misled).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from gguf import GGUFReader

PROBE = "The capital of France is Paris."
# Words of the probe as every GPT-2-style pre-tokenizer cuts them (an optional space, letters or punctuation).
_WORDS = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")
_SPM_SPACE = "▁"


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata of a GGUF file (llama.cpp's defaults where a key is absent)."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), …
    tokens: tuple[str, ...]
    merges: tuple[str, ...]  # "left right", by rank (BPE)
    scores: tuple[float, ...]  # per token (SentencePiece)
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    add_space_prefix: bool

    @classmethod
    def read(cls, path: str | Path) -> GGUFVocab:
        fields = GGUFReader(path).fields

        def value(key: str, default=None):
            return fields[key].contents() if key in fields else default

        model = value("tokenizer.ggml.model", "")
        spm = model == "llama"
        return cls(model, tuple(value("tokenizer.ggml.tokens", ())), tuple(value("tokenizer.ggml.merges", ())),
                   tuple(value("tokenizer.ggml.scores", ())), value("tokenizer.ggml.bos_token_id"),
                   value("tokenizer.ggml.eos_token_id"), bool(value("tokenizer.ggml.add_bos_token", spm)),
                   bool(value("tokenizer.ggml.add_space_prefix", spm)))

    def tokenize(self, text: str) -> list[int] | None:
        """The ids of ``text`` (no special tokens) as llama.cpp tokenizes this vocabulary; None for a vocabulary
        type not reproduced here."""
        ids = {token: i for i, token in enumerate(self.tokens)}
        if self.model == "gpt2" and self.merges:
            chars = _byte_chars()
            ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(self.merges)}
            words = ("".join(chars[b] for b in w.encode()) for w in _WORDS.findall(text))
            return [ids[piece] for word in words for piece in _merge(list(word), lambda a, b: -ranks.get((a, b), _NEVER))]
        if self.model == "llama" and self.scores:
            text = text.replace(" ", _SPM_SPACE)
            text = _SPM_SPACE + text if self.add_space_prefix else text
            score = dict(zip(self.tokens, self.scores))
            out = []
            for piece in _merge(list(text), lambda a, b: score.get(a + b, -_NEVER)):  # unknown characters: their bytes
                out += [ids[piece]] if piece in ids else [ids[f"<0x{b:02X}>"] for b in piece.encode()]
            return out
        return None


_NEVER = float("inf")


def _merge(pieces: list[str], priority) -> list[str]:
    """Merge adjacent pieces, the highest ``priority(left, right)`` first (leftmost among equals), until no pair
    can merge (priority -inf): BPE with priority -rank, SentencePiece with the merged piece's score."""
    while len(pieces) > 1:
        priorities = [priority(a, b) for a, b in zip(pieces, pieces[1:])]
        top = max(priorities)
        if top == -_NEVER:
            break
        i = priorities.index(top)
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


@cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character byte-level BPE vocabularies store."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def problems(tokenizer, vocab: GGUFVocab) -> tuple[list[str], list[str]]:
    """(errors, warnings): where ``tokenizer`` disagrees with the GGUF file's own tokenizer metadata."""
    errors, warnings = [], []
    # The file may name a BOS it never prepends (Qwen2.5: <|endoftext|>, add_bos_token false): only a used one counts.
    for name in ("bos_token_id", "eos_token_id")[0 if vocab.add_bos_token else 1 :]:
        mine, theirs = getattr(tokenizer, name), getattr(vocab, name)
        if theirs is not None and mine != theirs:
            errors.append(f"{name} is {mine} where the file names {theirs} ({vocab.tokens[theirs]!r})")
    ids = tokenizer(PROBE, add_special_tokens=False).input_ids
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    if decoded != PROBE:
        errors.append(f"{PROBE!r} decodes back as {decoded!r}")
    expected = vocab.tokenize(PROBE)
    if expected is not None and ids != expected:
        errors.append(f"{PROBE!r} is split into {tokenizer.convert_ids_to_tokens(ids)} where the file's vocabulary "
                      f"({vocab.model}) gives {[vocab.tokens[i] for i in expected]}")
    with_special = tokenizer(PROBE).input_ids
    adds_bos = tokenizer.bos_token_id is not None and with_special[:1] == [tokenizer.bos_token_id]
    if vocab.add_bos_token != adds_bos:
        warnings.append(f"the file says add_bos_token={vocab.add_bos_token}, the tokenizer "
                        f"{'prepends' if adds_bos else 'does not prepend'} BOS")
    return errors, warnings
