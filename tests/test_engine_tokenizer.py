"""Tokenizers: the byte tokenizer, a real ``tokenizer.json`` built with the ``tokenizers``
library, chat templates (built-in and Jinja2 from ``tokenizer_config.json``, sandboxed),
and streaming detokenisation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvxfer.engine import ByteTokenizer, HFTokenizer, load_tokenizer
from kvxfer.engine.tokenizer import TokenizerError

TEXT = "héllo wörld — 😀 tokens"
CORPUS = ["hello world", "héllo wörld", "the quick brown fox", "tokens and more tokens",
          "paged KV cache blocks", "😀 smile"] * 20
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] "
                 "{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


def build_tokenizer_json() -> str:
    """A small byte-level BPE with <s>/</s> and a post-processor that prepends <s>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    return str(tokenizer.to_str())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf_tokenizer")
    (path / "tokenizer.json").write_text(build_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}))
    return path


def stream(tokenizer: ByteTokenizer | HFTokenizer, ids: list[int]) -> list[str]:
    detok = tokenizer.detokenizer()
    return [detok.step(i) for i in ids] + [detok.flush()]


def test_byte_tokenizer_round_trip_and_specials() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == 256 and bytes(ids[1:]) == TEXT.encode()
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    assert tok.decode([256, *ids[1:], 257]) == TEXT
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # half of "€"
    with pytest.raises(ValueError, match=r"token id 300 is outside the byte vocabulary"):
        tok.decode([300])


def test_byte_streaming_emits_whole_characters_only() -> None:
    deltas = stream(ByteTokenizer(), list(TEXT.encode()))
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert "😀" in deltas  # four bytes in, one character out


def test_byte_streaming_flushes_an_unfinished_character() -> None:
    detok = ByteTokenizer().detokenizer()
    assert [detok.step(i) for i in (ord("a"), 0xF0, 0x9F)] == ["a", "", ""]
    assert detok.flush() == "\ufffd"


def test_byte_chat_template() -> None:
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert tok.encode_chat(messages) == [256, *text.encode()]
    with pytest.raises(ValueError, match="chat message 1 must have string 'role' and 'content'"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user"}])
    with pytest.raises(ValueError, match=r"chat messages must be a non-empty list, got \[\]"):
        tok.apply_chat_template([])


def test_hf_tokenizer_from_directory(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and 258 < tok.vocab_size <= 400
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(TEXT, add_special_tokens=False) == ids[1:]
    assert tok.decode([*ids, tok.eos_token_id]) == TEXT


def test_hf_streaming_matches_decode_without_replacement_characters(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some ids are partial characters
    deltas = stream(tok, ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_hf_chat_template_renders_with_jinja(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    messages = [{"role": "user", "content": "hello world"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s>[USER] hello world</s>\n[ASSISTANT] "
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS, none added on top


def write_config(path: Path, template: object) -> Path:
    path.mkdir(exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


def test_chat_template_runs_sandboxed(tmp_path: Path) -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = load_tokenizer(write_config(tmp_path / "a", escape))
    with pytest.raises(ValueError, match=r"chat template failed on these messages: .*unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    mutate = "{% set _ = messages.append({'role': 'x', 'content': 'y'}) %}ok"
    tok = load_tokenizer(write_config(tmp_path / "b", mutate))
    with pytest.raises(ValueError, match="chat template failed on these messages"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_errors_and_variants(tmp_path: Path) -> None:
    raising = "{{ raise_exception('only user messages, got ' + messages[0]['role']) }}"
    tok = load_tokenizer(write_config(tmp_path / "raise", raising))
    assert isinstance(tok, ByteTokenizer)  # no tokenizer.json: bytes, with the template
    with pytest.raises(ValueError, match="only user messages, got system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(TokenizerError, match="chat template does not parse"):
        load_tokenizer(write_config(tmp_path / "broken", "{% for %}"))
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert load_tokenizer(write_config(tmp_path / "named", named)) \
        .apply_chat_template([{"role": "user", "content": "x"}]) == "D"
    with pytest.raises(TokenizerError, match="chat_template must be a string, got int"):
        load_tokenizer(write_config(tmp_path / "int", 5))
    jinja_dir = tmp_path / "jinja"
    jinja_dir.mkdir()
    (jinja_dir / "chat_template.jinja").write_text("{{ messages | tojson }}")
    assert load_tokenizer(jinja_dir).apply_chat_template([{"role": "u", "content": "é"}]) == \
        '[{"role": "u", "content": "é"}]'


def test_malformed_tokenizer_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"cannot load .*tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json is not valid JSON"):
        load_tokenizer(tmp_path)
    assert isinstance(load_tokenizer(None), ByteTokenizer)
