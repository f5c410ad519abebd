"""Tokenizers: the built-in byte tokenizer and a wrapper for a checkpoint's ``tokenizer.json``.

Both expose the same small surface (:class:`Tokenizer`): ``encode``, ``decode``
(special ids are skipped), chat rendering, and an :class:`IncrementalDetokenizer`
for streaming that never emits half a UTF-8 character.

Chat: a checkpoint's ``chat_template`` (``tokenizer_config.json`` or
``chat_template.jinja``) is rendered with a sandboxed Jinja2 environment, the way
Hugging Face renders it; without one, :data:`DEFAULT_CHAT_FORMAT` is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

BYTE_VOCAB_SIZE = 258
BYTE_BOS = 256
BYTE_EOS = 257

# The built-in chat format: one "<|role|>\ncontent\n" block per message, then the
# assistant header the model continues from, "<|assistant|>\n".
DEFAULT_CHAT_FORMAT = "<|{role}|>\n{content}\n"
DEFAULT_GENERATION_PROMPT = "<|assistant|>\n"


class TokenizerError(ValueError):
    """A tokenizer file or chat template cannot be used; the message names it."""


def check_messages(messages: Sequence[dict[str, Any]]) -> None:
    """Chat messages must be ``{"role": str, "content": str}`` dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"chat messages must be a non-empty list, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"chat message {i} must have string 'role' and 'content', "
                             f"got {message!r}")


class ChatTemplate:
    """A Hugging Face chat template rendered in a sandboxed Jinja2 environment."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, indent: int | None = None) -> str:
            return json.dumps(value, ensure_ascii=False, indent=indent)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = tojson
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise TokenizerError(f"chat template does not parse: {exc}") from None
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True,
                                         **self._specials)
        except TemplateError as exc:
            raise ValueError(f"chat template failed on these messages: {exc}") from None


def default_chat_text(messages: Sequence[dict[str, Any]]) -> str:
    """The built-in chat format (see :data:`DEFAULT_CHAT_FORMAT`)."""
    blocks = [DEFAULT_CHAT_FORMAT.format(role=m["role"], content=m["content"]) for m in messages]
    return "".join(blocks) + DEFAULT_GENERATION_PROMPT


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, holding back incomplete characters.

    Keeps a small window of ids: the text of ``ids[prefix:]`` minus the text of
    ``ids[prefix:read]`` is the new text. A window that decodes to a trailing
    U+FFFD is an unfinished multi-byte character and waits for the next id;
    :meth:`flush` releases whatever is left when the stream ends. ``context_ids``
    (the prompt's tail) give tokenizers that drop a leading space their context.
    """

    def __init__(self, decode: Callable[[list[int]], str], context_ids: Sequence[int] = ()
                 ) -> None:
        self._decode = decode
        self._ids = list(context_ids)
        self._prefix = 0
        self._read = len(self._ids)

    def step(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is unfinished)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str: ...
    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]: ...
    def detokenizer(self, context_ids: Sequence[int] = ()) -> IncrementalDetokenizer: ...


class ByteTokenizer:
    """Ids 0-255 are the UTF-8 bytes of the text; 256 is BOS, 257 is EOS."""

    vocab_size = BYTE_VOCAB_SIZE
    bos_token_id: int | None = BYTE_BOS
    eos_token_id: int | None = BYTE_EOS

    def __init__(self, chat_template: ChatTemplate | None = None) -> None:
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes, preceded by BOS when ``add_special_tokens``."""
        ids = list(text.encode("utf-8"))
        return [BYTE_BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes of the non-special ids, decoded with ``errors="replace"``."""
        for token in ids:
            if not 0 <= token < BYTE_VOCAB_SIZE:
                raise ValueError(f"token id {token} is outside the byte vocabulary "
                                 f"[0, {BYTE_VOCAB_SIZE})")
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        check_messages(messages)
        if self.chat_template is not None:
            return self.chat_template.render(messages)
        return default_chat_text(messages)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """BOS + the chat text's bytes (BOS is not a byte, so no template can spell it)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=True)

    def detokenizer(self, context_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        # Bytes need no context: a byte's text never depends on the bytes before the output.
        return IncrementalDetokenizer(self.decode)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``."""

    def __init__(self, tokenizer: Any, chat_template: ChatTemplate | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        check_messages(messages)
        if self.chat_template is not None:
            return self.chat_template.render(messages)
        return default_chat_text(messages)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """A template writes its own special tokens (BOS included), so none are added."""
        text = self.apply_chat_template(messages)
        return self.encode(text, add_special_tokens=self.chat_template is None)

    def detokenizer(self, context_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        # A few prompt ids of context let sentencepiece-style decoders keep leading spaces.
        return IncrementalDetokenizer(self.decode, list(context_ids)[-5:])


def _special_token_text(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(directory: Path, config: dict[str, Any]) -> str | None:
    """The template text: ``chat_template.jinja``, else tokenizer_config's ``chat_template``
    (a string, or a list of named templates of which "default" is used)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is not None and not isinstance(source, str):
        raise TokenizerError(f"{directory / 'tokenizer_config.json'}: chat_template must be "
                             f"a string, got {type(source).__name__}")
    return source


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return value


def load_tokenizer(directory: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a checkpoint directory; the byte tokenizer for ``None`` or a
    directory without ``tokenizer.json``."""
    if directory is None:
        return ByteTokenizer()
    path = Path(directory)
    config = _read_json(path / "tokenizer_config.json")
    bos, eos = _special_token_text(config, "bos_token"), _special_token_text(config, "eos_token")
    source = _chat_template_source(path, config)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        template = None if source is None else ChatTemplate(source)
        return ByteTokenizer(template)
    from tokenizers import Tokenizer as RawTokenizer

    try:
        raw = RawTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(f"cannot load {tokenizer_file}: {exc}") from None
    template = None if source is None else ChatTemplate(source, bos or "", eos or "")
    return HFTokenizer(raw, template,
                       bos_token_id=None if bos is None else raw.token_to_id(bos),
                       eos_token_id=None if eos is None else raw.token_to_id(eos))
