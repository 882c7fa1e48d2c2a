"""A GGUF file's tokenizer rebuilt from the file's own vocabulary, for files transformers converts wrongly.

Built from ``tokenizers`` models, as llama.cpp tokenizes the vocabulary type the file names
(``tokenizer.ggml.model``):

- ``llama`` (SentencePiece BPE): llama.cpp merges the adjacent pair whose joined piece scores highest,
  leftmost among equals. That is a BPE whose merges are every split of a piece into two pieces, ranked by the
  piece's score. Spaces become "▁" ("▁" first where ``add_space_prefix`` says), characters outside the
  vocabulary fall back to their ``<0xNN>`` byte pieces.
- ``gpt2`` (byte-level BPE): the file's merges by rank, after the pre-tokenizer regexes llama.cpp uses for the
  file's ``tokenizer.ggml.pre``.

Control tokens become special tokens (dropped when decoding with ``skip_special_tokens``); user-defined ones
are cut out of the raw text before the model sees it, as llama.cpp does. BOS and EOS are prepended and
appended as the file's ``add_bos_token`` and ``add_eos_token`` say.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from pipeline.gguf_tokenizer import CONTROL, SPM_SPACE, UNKNOWN, USER_DEFINED, GGUFVocab

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# llama.cpp's pre-tokenizers by tokenizer.ggml.pre: regexes applied in turn, each splitting the pieces further.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    **dict.fromkeys(("gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais"), (_GPT2,)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "megrez"), (_QWEN2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (r"\p{N}", _GPT2)),
}
# Pre-tokenizers whose words that are whole tokens skip the merges (llama.cpp's ignore_merges).
_WHOLE_WORDS = {"llama3", "llama-v3", "llama-bpe", "falcon3"}


class RebuildError(ValueError):
    """The file's tokenizer metadata cannot make a tokenizer; the message names the field."""


def rebuild_tokenizer(vocab: GGUFVocab) -> PreTrainedTokenizerFast:
    """A transformers tokenizer that tokenizes as llama.cpp does from ``vocab``, the file's own metadata."""
    _check(vocab)
    tokenizer = _sentencepiece_bpe(vocab) if vocab.model == "llama" else _byte_level_bpe(vocab)
    kinds = dict(zip(vocab.tokens, vocab.token_types))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in kinds.items()
                                  if kind in (CONTROL, UNKNOWN)])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in kinds.items()
                          if kind == USER_DEFINED])

    def token(i: int | None) -> str | None:
        return None if i is None else vocab.tokens[i]

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=token(vocab.bos_token_id), eos_token=token(vocab.eos_token_id),
        unk_token=token(vocab.unknown_token_id), pad_token=token(vocab.padding_token_id),
        add_bos_token=vocab.add_bos_token and vocab.bos_token_id is not None,
        add_eos_token=vocab.add_eos_token and vocab.eos_token_id is not None, clean_up_tokenization_spaces=False)


def _check(vocab: GGUFVocab) -> None:
    if contradictions := vocab.contradictions():
        raise RebuildError("; ".join(contradictions))
    if vocab.model not in ("llama", "gpt2"):
        raise RebuildError(f"tokenizer.ggml.model is {vocab.model!r}: only 'llama' (SentencePiece) and 'gpt2' "
                           f"(byte-level BPE) vocabularies are rebuilt")
    if vocab.model == "llama" and not vocab.scores:
        raise RebuildError("tokenizer.ggml.scores is missing: a SentencePiece vocabulary merges by score")
    if vocab.model == "gpt2" and vocab.pre not in PRE_TOKENIZERS:
        raise RebuildError(f"tokenizer.ggml.pre is {vocab.pre!r}, a pre-tokenizer not rebuilt here; "
                           f"known: {sorted(PRE_TOKENIZERS)}")


def _sentencepiece_bpe(vocab: GGUFVocab) -> Tokenizer:
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    splits = [(score, token[:k], token[k:]) for token, score in zip(vocab.tokens, vocab.scores)
              for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
    splits.sort(key=lambda split: -split[0])  # stable: a piece's splits stay together
    unk = None if vocab.unknown_token_id is None else vocab.tokens[vocab.unknown_token_id]
    tokenizer = Tokenizer(BPE(ids, [(left, right) for _, left, right in splits], unk_token=unk, byte_fallback=True))
    prefix = [normalizers.Prepend(SPM_SPACE)] if vocab.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPM_SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *strip])
    return tokenizer


def _byte_level_bpe(vocab: GGUFVocab) -> Tokenizer:
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    unknown = sorted({piece for merge in merges for piece in (*merge, "".join(merge)) if piece not in ids})
    if unknown or any(len(merge) != 2 for merge in merges):
        raise RebuildError(f"tokenizer.ggml.merges names pieces outside tokenizer.ggml.tokens ({unknown[:5]}) or "
                           f"entries that are no 'left right' pair")
    tokenizer = Tokenizer(BPE(ids, merges, ignore_merges=vocab.pre in _WHOLE_WORDS))
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in PRE_TOKENIZERS[vocab.pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                         use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
