"""A request's prompt tokens as the instances will see them, for kv_aware's scores.

Tokenized once per request, with the model's own tokenizer and chat template
(``--tokenizer``: a checkpoint directory, or ``byte`` for kvxfer's byte tokenizer), the way
a kvxfer sidecar or vLLM applies them to a completion's text and a chat's messages. A
prompt given as token ids needs no tokenizer. A prompt that cannot be tokenized here is
scored as unknown (routed by load) and left for the instance to accept or refuse.

Design: docs/design/kv-events.md#scoring
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.balancer import Prompt
from proxy.contract import CHAT_COMPLETIONS, COMPLETIONS

if TYPE_CHECKING:
    from kvxfer.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BYTE_TOKENIZER = "byte"


class TokenizerError(ValueError):
    """``--tokenizer`` names nothing this proxy can load; the message says why."""


def load_tokenizer(name: str | None) -> Tokenizer | None:
    """The tokenizer ``--tokenizer`` names (None: none)."""
    if name is None:
        return None
    from kvxfer.engine.tokenizer import TokenizerError as Unusable
    from kvxfer.engine.tokenizer import load_tokenizer as load  # tokenizers, jinja2: no torch

    if name != BYTE_TOKENIZER and not Path(name).is_dir():
        raise TokenizerError(f"{name} is no directory (a checkpoint's, with "
                             f"tokenizer.json), nor {BYTE_TOKENIZER!r}")
    try:
        return load(None if name == BYTE_TOKENIZER else name)
    except Unusable as exc:
        raise TokenizerError(str(exc)) from None


class Prompts:
    """Turns a completion body into its :class:`~proxy.balancer.Prompt`."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def of(self, route: str, body: dict[str, Any]) -> Prompt | None:
        """The prompt of one-prompt ``body`` on ``route``; None when it is unknown here."""
        tokens = self._token_ids(route, body)
        return None if tokens is None else Prompt(tokens)

    def _token_ids(self, route: str, body: dict[str, Any]) -> list[int] | None:
        if route == COMPLETIONS:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return prompt
            if isinstance(prompt, str) and self.tokenizer is not None:
                return self.tokenizer.encode(prompt)
            return None
        if route == CHAT_COMPLETIONS and self.tokenizer is not None:
            try:
                return self.tokenizer.encode_chat(body.get("messages"))  # type: ignore[arg-type]
            except Exception as exc:  # the instance answers it; here it is only scored
                log.debug("chat messages not tokenized for routing: %s", exc)
        return None
