"""Tokenizer wrapper over a tiny WordLevel tokenizer.json built in the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, processors

from engine.tokenizer import Tokenizer

VOCAB = {
    "<unk>": 0,
    "<s>": 1,
    "</s>": 2,
    "hello": 3,
    "world": 4,
    "user": 5,
    "assistant": 6,
    "<eot>": 7,
}

TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}"
    "{% endif %}"
    "{{ m['role'] }} {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def write_tokenizer_json(model_dir: Path) -> None:
    tok = tokenizers.Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<eot>"])
    # Llama-style: the post-processor, not the wrapper, prepends BOS.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.save(str(model_dir / "tokenizer.json"))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    write_tokenizer_json(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "</s>", "special": True},
                "chat_template": TEMPLATE,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return tmp_path


def test_missing_tokenizer_json_gives_none(tmp_path: Path) -> None:
    assert Tokenizer.from_dir(tmp_path) is None


def test_encode_decode_roundtrip(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tok.encode("hello mars", add_special_tokens=False) == [3, 0]
    assert tok.decode([1, 3, 4, 2]) == "hello world"
    assert tok.decode([1, 3, 4, 2], skip_special_tokens=False) == "<s> hello world </s>"
    assert tok.vocab_size == len(VOCAB)
    assert tok.token_to_id("world") == 4


def test_special_token_ids(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(str(model_dir))
    assert tok is not None
    assert tok.eos_token_id == 2 and tok.eos_token == "</s>"
    assert tok.eos_token_ids == [2, 7]
    assert tok.bos_token_id == 1 and tok.bos_token == "<s>"


def test_special_ids_fall_back_to_model_config(tmp_path: Path) -> None:
    write_tokenizer_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7, "bos_token_id": 1}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok is not None
    assert tok.eos_token_id == 7 and tok.eos_token == "<eot>"
    assert tok.bos_token_id == 1 and tok.bos_token == "<s>"
    assert tok.chat_template is None


def test_no_special_ids_anywhere(tmp_path: Path) -> None:
    write_tokenizer_json(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok is not None
    assert tok.eos_token_id is None and tok.bos_token_id is None
    assert tok.eos_token_ids == []


def test_chat_template(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    assert tok.chat_template == TEMPLATE
    messages = [{"role": "user", "content": "hello"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s>user hello </s> assistant "
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "<s>user hello </s> "
    # The rendered text already has BOS: encode it without specials.
    assert tok.encode(text, add_special_tokens=False) == [1, 5, 3, 2, 6]


def test_chat_template_raise_exception(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    with pytest.raises(ValueError, match="bad role system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_template_file_and_missing_template(tmp_path: Path) -> None:
    write_tokenizer_json(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok is not None
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | tojson }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok is not None
    assert tok.apply_chat_template([{"role": "user", "content": "hé"}]) == '"hé"'


def test_named_chat_templates_use_default(tmp_path: Path) -> None:
    write_tokenizer_json(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "TOOLS"},
                    {"name": "default", "template": "DEFAULT"},
                ]
            }
        )
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok is not None
    assert tok.apply_chat_template([]) == "DEFAULT"
