"""Thin wrapper over a HF ``tokenizer.json`` (``tokenizers`` library only, no transformers).

BOS handling: :meth:`Tokenizer.encode` with ``add_special_tokens=True`` adds
whatever the ``tokenizer.json`` post-processor adds (HF Llama tokenizers add
BOS there); this wrapper never inserts BOS itself. Chat templates usually
render ``bos_token`` into the text, so encode a rendered chat prompt with
``add_special_tokens=False`` to avoid a double BOS (as vLLM does).

Special-token ids are resolved from, in order: ``tokenizer_config.json``
(``eos_token``/``bos_token`` strings), ``generation_config.json``, then
``config.json`` (``eos_token_id``/``bos_token_id``; a list means "any of these",
and the first is reported as the main id).

GGUF files: :meth:`Tokenizer.from_gguf` rebuilds the tokenizer from the file's
``tokenizer.ggml.*`` metadata (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``);
:func:`load_tokenizer` prefers a ``tokenizer.json`` beside the model and falls back to
the GGUF one for ``load_format="gguf"``.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers

logger = logging.getLogger(__name__)

# gguf.TokenType values (llama.cpp's llama_token_type).
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4


class Tokenizer:
    """Encode/decode text and render chat prompts for one model directory."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        tokenizer_config: dict[str, Any] | None = None,
        model_config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self._config = tokenizer_config or {}
        configs = [generation_config or {}, model_config or {}]

        self.eos_token: str | None = _token_content(self._config.get("eos_token"))
        self.bos_token: str | None = _token_content(self._config.get("bos_token"))
        #: Every id that ends generation (e.g. Llama 3's <|end_of_text|> and <|eot_id|>).
        self.eos_token_ids: list[int] = self._resolve_ids(self.eos_token, "eos_token_id", configs)
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        bos_ids = self._resolve_ids(self.bos_token, "bos_token_id", configs)
        self.bos_token_id: int | None = bos_ids[0] if bos_ids else None
        if self.eos_token is None and self.eos_token_id is not None:
            self.eos_token = self._tok.id_to_token(self.eos_token_id)
        if self.bos_token is None and self.bos_token_id is not None:
            self.bos_token = self._tok.id_to_token(self.bos_token_id)

        self.chat_template: str | None = chat_template or _template_from_config(self._config)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer | None:
        """Load ``model_dir/tokenizer.json`` and its side configs; None if it has none."""
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            return None
        template_file = root / "chat_template.jinja"
        chat_template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        if chat_template is None:
            template_json = _read_json(root / "chat_template.json")
            chat_template = _template_from_config(template_json)
        return cls(
            tokenizers.Tokenizer.from_file(str(path)),
            tokenizer_config=_read_json(root / "tokenizer_config.json"),
            model_config=_read_json(root / "config.json"),
            generation_config=_read_json(root / "generation_config.json"),
            chat_template=chat_template,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer | None:
        """The tokenizer stored in a GGUF file's metadata; None if it stores none (or one not supported).

        Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE, as llama.cpp's
        convert_hf_to_gguf.py writes Llama 3 / Qwen2 / GPT-2-style tokenizers). Control
        tokens (type 3) become special tokens, user-defined ones (type 4) added tokens;
        BOS is prepended by the post-processor when ``tokenizer.ggml.add_bos_token`` is true.
        """
        from model_loader.gguf_utils import open_gguf  # lazily: only GGUF models need it

        metadata = open_gguf(path, "r").metadata

        def get(key: str, default: Any = None) -> Any:
            return metadata.get(key, default)

        model = get("tokenizer.ggml.model")
        if model is None or get("tokenizer.ggml.tokens") is None:
            return None
        if model != "gpt2":
            logger.warning("%s: GGUF tokenizer type %r is not supported (only 'gpt2' byte-level BPE); "
                           "no tokenizer loaded, pass token ids or put a tokenizer.json beside the file",
                           path, model)
            return None
        tokens: list[str] = list(get("tokenizer.ggml.tokens"))
        merges: list[str] = list(get("tokenizer.ggml.merges", []))
        types: list[int] = [int(t) for t in get("tokenizer.ggml.token_type", [])] or [1] * len(tokens)
        vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
        pairs = []
        for merge in merges:
            cut = merge.find(" ", 1)  # as llama.cpp: the first token itself may start with a space
            pairs.append((merge[:cut], merge[cut + 1:]))
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, pairs))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = tokenizers.decoders.ByteLevel()
        specials = [tokens[i] for i, t in enumerate(types) if t == _GGUF_TOKEN_CONTROL]
        added = [tokens[i] for i, t in enumerate(types) if t == _GGUF_TOKEN_USER_DEFINED]
        if added:
            tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in added])
        if specials:
            tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])

        def token_id(key: str) -> int | None:
            value = get(key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos_id, eos_id = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
        add_bos = bool(get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
        add_eos = bool(get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
        if add_bos or add_eos:
            single, pair, special_ids = "$A", "$A $B:1", {}
            if add_bos:
                bos = tokens[bos_id]
                single, pair = f"{bos} {single}", f"{bos} $A {bos}:1 $B:1"
                special_ids[bos] = bos_id
            if add_eos:
                eos = tokens[eos_id]
                single, pair = f"{single} {eos}", f"{pair} {eos}:1"
                special_ids[eos] = eos_id
            tok.post_processor = tokenizers.processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=list(special_ids.items()))

        tokenizer_config: dict[str, Any] = {}
        model_config: dict[str, Any] = {}
        if bos_id is not None:
            tokenizer_config["bos_token"], model_config["bos_token_id"] = tokens[bos_id], bos_id
        if eos_id is not None:
            # End-of-turn ids (Llama 3's <|eot_id|>, <|eom_id|>) also end generation.
            extra = [token_id(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
            tokenizer_config["eos_token"] = tokens[eos_id]
            model_config["eos_token_id"] = [eos_id, *(i for i in extra if i is not None and i != eos_id)]
        template = get("tokenizer.chat_template")
        return cls(tok, tokenizer_config=tokenizer_config, model_config=model_config,
                   chat_template=template if isinstance(template, str) else None)

    @property
    def backend_tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` this wraps (transformers' name for it), for
        libraries that read its vocabulary and model type (xgrammar)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; specials come only from the post-processor."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Each id's token string as the vocabulary spells it (e.g. "Ġworld"); "" for an unknown id."""
        return [self._tok.id_to_token(int(i)) or "" for i in ids]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, **template_kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template (HF conventions);
        ``tools`` (a request's OpenAI function tools) is the template's ``tools``
        variable, as transformers passes it (None: no tools); ``template_kwargs`` (a
        request's ``chat_template_kwargs``) are extra template variables, which cannot
        replace ``messages``, ``add_generation_prompt`` or ``tools``.

        Raises ``ValueError`` if the model has no chat template or the template
        calls ``raise_exception``.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template; cannot render chat messages")
        # Imported lazily: only chat requests need jinja2.
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template error: {message}")

        def tojson(value: Any, indent: int | None = None) -> str:
            return json.dumps(value, indent=indent, ensure_ascii=False)

        # Same environment settings as transformers, so templates render identically.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        special = {
            key: _token_content(value)
            for key, value in self._config.items()
            if key.endswith("_token") and _token_content(value) is not None
        }
        special.update(bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        variables = {**special, **template_kwargs}
        return env.from_string(self.chat_template).render(
            variables, messages=messages, add_generation_prompt=add_generation_prompt, tools=tools
        )

    def _resolve_ids(
        self, token: str | None, key: str, configs: list[dict[str, Any]]
    ) -> list[int]:
        if token is not None:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                extra = [i for c in configs for i in _as_id_list(c.get(key)) if i != token_id]
                return [token_id, *dict.fromkeys(extra)]
        for config in configs:
            ids = _as_id_list(config.get(key))
            if ids:
                return ids
        return []


def load_tokenizer(model: str | os.PathLike[str], load_format: str = "auto") -> Tokenizer | None:
    """The model's tokenizer: ``tokenizer.json`` in directory ``model`` (``Tokenizer.from_dir``), or,
    for ``load_format="gguf"``, the ``tokenizer.json`` beside the GGUF file, else the GGUF's own."""
    if load_format != "gguf":
        return Tokenizer.from_dir(model)
    from model_loader.gguf_utils import find_gguf_file

    path = find_gguf_file(model)
    return Tokenizer.from_dir(path.parent) or Tokenizer.from_gguf(path)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as configured: a plain string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _template_from_config(config: dict[str, Any]) -> str | None:
    """``chat_template`` as a string, or the "default" entry of a named list."""
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None
