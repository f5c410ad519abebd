"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers.Tokenizer``.

Only byte-level BPE with a pre-tokenizer in :data:`PRE_TOKENIZERS` is rebuilt; anything else
is refused rather than guessed (a wrong split gives ids the model was not trained on).

Design: docs/design/models.md#the-tokenizer-of-a-gguf-file
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvxfer.engine.gguf import GGUFFile

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4


def _byte_level() -> Any:
    """GPT-2's split regex, then bytes to printable characters."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> Any:
    """llama.cpp's ``\\p{N}`` split before the GPT-2 regex: every digit alone. This is
    the pre-tokenizer of StarCoder's and SmolLM's published ``tokenizer.json``."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    _byte_level()])


# tokenizer.ggml.pre -> the equivalent pre-tokenizer. llama.cpp gives "smollm" and
# "starcoder" the same regexes: "\p{N}", then GPT-2's.
PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "gpt2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
}


def build_tokenizer(file: GGUFFile) -> Any:
    """The ``tokenizers.Tokenizer`` of the file's vocabulary, merges and special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = file.get("tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise file.error(f"tokenizer model {kind!r} is not supported (only byte-level BPE, "
                         f"'gpt2')")
    pre = file.get("tokenizer.ggml.pre", str, "default")
    if pre not in PRE_TOKENIZERS:
        raise file.error(f"pre-tokenizer {pre!r} is not supported (supported: "
                         f"{', '.join(PRE_TOKENIZERS)})")
    tokens = file.get("tokenizer.ggml.tokens", list)
    types = file.get("tokenizer.ggml.token_type", list, [TOKEN_NORMAL] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens) or len(types) != len(tokens):
        raise file.error(f"tokenizer has {len(tokens)} tokens, {len(vocab)} distinct, and "
                         f"{len(types)} token types")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges(file), fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are special: matched whole, skipped when decoding.
    # User-defined ones are matched whole too but decode as text.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types, strict=True)
                                  if k == TOKEN_CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types, strict=True) if k == TOKEN_USER_DEFINED])
    bos = _token(file, "bos", tokens)
    if file.get("tokenizer.ggml.add_bos_token", bool, False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return tokenizer


def _merges(file: GGUFFile) -> list[tuple[str, str]]:
    pairs = []
    for i, merge in enumerate(file.get("tokenizer.ggml.merges", list, [])):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise file.error(f"merge {i} ({merge!r}) is not two tokens separated by a space")
        pairs.append((parts[0], parts[1]))
    return pairs


def _token(file: GGUFFile, which: str, tokens: list[str]) -> str | None:
    """The text of the ``which`` ("bos"/"eos") token, or None when the file names none."""
    token_id: int | None = file.get(f"tokenizer.ggml.{which}_token_id", int, None)
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise file.error(f"tokenizer.ggml.{which}_token_id={token_id} is outside the "
                         f"{len(tokens)} tokens")
    return tokens[token_id]


def tokenizer_config(file: GGUFFile) -> dict[str, Any]:
    """The file's special tokens and chat template as a ``tokenizer_config.json`` dict."""
    tokens = file.get("tokenizer.ggml.tokens", list)
    config: dict[str, Any] = {"bos_token": _token(file, "bos", tokens),
                              "eos_token": _token(file, "eos", tokens)}
    template = file.get("tokenizer.chat_template", str, None)
    if template is not None:
        config["chat_template"] = template
    return config

