"""SmolLM2's tokenizer rebuilt from its GGUF metadata gives the ids of an independent
reference on a few hundred strings, renders the ChatML template and decodes back.

The reference is ``transformers``' own GGUF tokenizer (``AutoTokenizer.from_pretrained(
dir, gguf_file=...)``) with one correction. transformers has no entry for
``tokenizer.ggml.pre = "smollm"`` and keeps GPT-2's ByteLevel split, which does not
isolate digits. SmolLM2's published ``tokenizer.json`` runs ``Digits(individual_digits=
true)`` before ByteLevel, and llama.cpp's "smollm" pre-tokenizer splits on ``\\p{N}``
before GPT-2's regex: the model was trained with every digit on its own. The two differ
where whitespace precedes a digit: "a  2" is [a, "ĠĠ", 2] for SmolLM2 and llama.cpp,
[a, "Ġ", "Ġ", 2] for transformers (digits never merge either way: the vocabulary has no
multi-digit token). So the reference encodes the text cut before and after every
numeric character, which is exactly what the Digits pre-tokenizer does, and is
transformers everywhere else.
"""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from kvxfer.engine.model_cache import gguf_checkpoint
from kvxfer.engine.model_names import MODELS
from kvxfer.engine.tokenizer import HFTokenizer, load_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>",
           "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>",
           "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
           "<jupyter_output>", "<jupyter_script>", "<empty_output>"]

CASES = [
    "", " ", "  ", "Hello world", "Hello, world!", "  leading spaces", "trailing spaces   ",
    "tabs\tand\nnewlines\r\nmixed", "\n\n\n", " \n \n ", "a  2", "x 123 456", "3.14159",
    "1,000,000.00", "2024-06-30T12:34:56Z", "0x1F 0b1010 1e-5", "①②③ ½ ¾ Ⅻ ²³",
    "٣٤٥ and १२३", "日本語のテキストです。", "中文分词测试", "한국어 문장", "Привет, мир!",
    "Ünïcödé façade naïve café", "e\u0301 combining", "zero\u200bwidth\u200djoiner",
    "emoji 🤖👍🏽 family 👨‍👩‍👧", "🤖2024", "\ufeffBOM first", "\x00\x01\x7f control",
    "I'm it's we've they'll she'd you're", "DON'T SHOUT", "CamelCaseWord snake_case_word",
    "mixed123abc456def", "$100 €20 £5 ¥3", "a.b@c.de https://example.com/a?b=1&c=2",
    "def f(x):\n    return x ** 2\n", "if (a && b) { c++; }", "    indented 4", "\tindented tab",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>", "<repo_name>kvxfer<file_sep>a.py<filename>",
    "not special: <|im_start and im_end|>", "<|im_end|>3 <|im_end|> 4", "<jupyter_code>x = 1",
    "word" * 40, "1" * 50, " " * 17 + "x", "a\u00a0b non-breaking", "ﬁ ligature ﬀ",
    "Ελληνικά κείμενα", "עברית", "العربية 123", "ไทย", "Tiếng Việt có dấu",
]

FRAGMENTS = [
    "the", "The", " quick", "brown", "fox", "jumps", "über", "naïve", "日本", "語", "🤖",
    "👍🏽", "0", "7", "42", "2024", "3.5", "½", "①", "٣", "!", "?", "...", "--", "(", ")",
    "{", "}", "'s", "'ll", "n't", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<filename>",
    "user", "assistant", "\u0301", "\u200b", "ß", "Ж", "ñ", "\\", "/", "#", "@", "&", "_",
    "é", "ﬁ", "€", "tab", "x", "Y",
]
SEPARATORS = ["", "", " ", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\r\n", "\u3000"]


def _generated(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(SEPARATORS) + rng.choice(FRAGMENTS)
                    for _ in range(rng.randint(1, 10))) + rng.choice(SEPARATORS)
            for _ in range(count)]


TEXTS = CASES + _generated(300)


def _numeric(char: str) -> bool:
    """What ``tokenizers``' Digits pre-tokenizer splits on (Rust's ``char::is_numeric``)
    and llama.cpp's ``\\p{N}``: Unicode categories Nd, Nl and No."""
    return unicodedata.category(char) in ("Nd", "Nl", "No")


def reference_ids(hf: Any, text: str) -> list[int]:
    """transformers' ids of ``text`` cut around every numeric character (see the module
    docstring). No special token contains a digit, so none is cut."""
    pieces, current = [], ""
    for char in text:
        if _numeric(char):
            pieces += [current, char]
            current = ""
        else:
            current += char
    pieces.append(current)
    return [i for piece in pieces if piece
            for i in hf(piece, add_special_tokens=False)["input_ids"]]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    smol = MODELS["smollm2-135m-instruct"].gguf
    assert smol is not None
    return smol.locate()


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> HFTokenizer:
    tokenizer = load_tokenizer(gguf_checkpoint(gguf_path))  # the engine's path
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def hf(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def test_ids_match_the_reference_on_every_string(ours: HFTokenizer, hf: Any) -> None:
    assert len(TEXTS) >= 300
    mismatches = [(text, ours.encode(text), reference_ids(hf, text)) for text in TEXTS
                  if ours.encode(text) != reference_ids(hf, text)]
    assert not mismatches, f"{len(mismatches)} of {len(TEXTS)} differ, first: {mismatches[0]}"
    # No BOS is added (tokenizer.ggml.add_bos_token is false): the template writes its own.
    assert all(ours.encode(t, add_special_tokens=False) == ours.encode(t) for t in CASES)


def test_digits_stand_alone_as_in_smollm2s_published_tokenizer(ours: HFTokenizer, hf: Any
                                                               ) -> None:
    ids = hf.convert_tokens_to_ids
    assert ours.encode("a  2") == ids(["a", "ĠĠ", "2"])
    assert ours.encode("x 2024") == ids(["x", "Ġ", "2", "0", "2", "4"])
    assert ours.encode("<|im_start|>") == [1] and ours.encode("<|im_end|>") == [2]


def test_decode_gives_back_the_text_without_special_tokens(ours: HFTokenizer) -> None:
    for text in TEXTS:
        plain = text
        for token in SPECIAL:
            plain = plain.replace(token, "")
        assert ours.decode(ours.encode(text)) == plain, text


def test_chat_template_and_end_of_turn(ours: HFTokenizer, hf: Any) -> None:
    assert ours.eos_token_id == 2 and ours.bos_token_id == 1
    one = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(one) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    several = [{"role": "system", "content": "Answer in one word."},
               {"role": "user", "content": "Colour of the sky?"},
               {"role": "assistant", "content": "Blue."},
               {"role": "user", "content": "And grass, 2 words?"}]
    for messages in (one, several):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == text
        assert ours.encode_chat(messages) == reference_ids(hf, text)
    assert ours.apply_chat_template(several).startswith("<|im_start|>system\nAnswer in one")
