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

A tokenizer that fails is replaced by one rebuilt from the same metadata (``pipeline.gguf_rebuild``), checked
the same way. A file whose metadata contradicts itself (``GGUFVocab.contradictions``) cannot be checked at all.
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
SPM_SPACE = "▁"
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata of a GGUF file (llama.cpp's defaults where a key is absent)."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), …
    pre: str  # tokenizer.ggml.pre: the pre-tokenizer of a BPE vocabulary ("llama-bpe", "qwen2", …)
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]  # per token: NORMAL, CONTROL, USER_DEFINED, BYTE, …
    merges: tuple[str, ...]  # "left right", by rank (BPE)
    scores: tuple[float, ...]  # per token (SentencePiece)
    bos_token_id: int | None
    eos_token_id: int | None
    unknown_token_id: int | None
    padding_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    add_space_prefix: bool

    @classmethod
    def read(cls, path: str | Path) -> GGUFVocab:
        fields = GGUFReader(path).fields

        def value(key: str, default=None):
            return fields[f"tokenizer.ggml.{key}"].contents() if f"tokenizer.ggml.{key}" in fields else default

        model = value("model", "")
        spm = model == "llama"
        tokens = tuple(value("tokens", ()))
        return cls(model, value("pre", "default"), tokens, tuple(value("token_type", (NORMAL,) * len(tokens))),
                   tuple(value("merges", ())), tuple(value("scores", ())), value("bos_token_id"),
                   value("eos_token_id"), value("unknown_token_id"), value("padding_token_id"),
                   bool(value("add_bos_token", spm)), bool(value("add_eos_token", False)),
                   bool(value("add_space_prefix", spm)))

    def contradictions(self) -> list[str]:
        """Where the metadata disagrees with itself: no tokenizer can be checked against such a file."""
        n = len(self.tokens)
        found = [f"tokenizer.ggml.{name} has {len(values)} entries for {n} tokens"
                 for name, values in (("scores", self.scores), ("token_type", self.token_types))
                 if values and len(values) != n]
        if len(set(self.tokens)) != n:
            found.append(f"tokenizer.ggml.tokens has {n - len(set(self.tokens))} duplicate pieces")
        for name in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
            if (i := getattr(self, name)) is not None and not 0 <= i < n:
                found.append(f"tokenizer.ggml.{name} is {i}, outside the {n} tokens")
        return found

    def tokenize(self, text: str) -> list[int] | None:
        """The ids of ``text`` (no special tokens) as llama.cpp tokenizes this vocabulary; None for a vocabulary
        type not reproduced here."""
        if self.model == "gpt2" and self.merges:
            chars = _byte_chars()
            ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(self.merges)}

            def pieces(fragment: str) -> list[str]:
                words = ("".join(chars[b] for b in w.encode()) for w in _WORDS.findall(fragment))
                return [piece for word in words
                        for piece in _merge(list(word), lambda a, b: -ranks.get((a, b), _NEVER))]
        elif self.model == "llama" and self.scores:
            score = dict(zip(self.tokens, self.scores))

            def pieces(fragment: str) -> list[str]:
                fragment = fragment.replace(" ", SPM_SPACE)
                # "▁" first where the file says so, after a user-defined token too (as llama.cpp does)
                fragment = SPM_SPACE + fragment if self.add_space_prefix else fragment
                return _merge(list(fragment), lambda a, b: score.get(a + b, -_NEVER))
        else:
            return None
        ids = {token: i for i, token in enumerate(self.tokens)}
        # User-defined tokens ("\n", runs of spaces in Gemma's vocabulary) are cut out of the raw text first.
        user_defined = sorted((t for t, kind in zip(self.tokens, self.token_types) if kind == USER_DEFINED), key=len,
                              reverse=True)
        fragments = re.split(f"({'|'.join(map(re.escape, user_defined))})", text) if user_defined else [text]
        out = []
        for i, fragment in enumerate(fragments):
            if i % 2:
                out.append(ids[fragment])
                continue
            for piece in pieces(fragment) if fragment else ():  # a character the vocabulary lacks: its bytes
                out += [ids[piece]] if piece in ids else [ids.get(f"<0x{b:02X}>", self.unknown_token_id)
                                                          for b in piece.encode()]
        return out


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
