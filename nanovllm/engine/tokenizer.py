"""Text <-> token ids, from a Hugging Face model directory or a GGUF file (chat templates
in chat_template.py).

Runtime needs only `tokenizers`, `jinja2` and `gguf`: importing `transformers` costs seconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING, Any

import gguf
from tokenizers import Tokenizer as BackendTokenizer

from nanovllm.core.errors import InvalidRequestError, ModelLoadError
from nanovllm.engine.chat_template import (  # noqa: F401 (ChatTemplateError re-exported)
    ChatTemplate,
    ChatTemplateError,
    read_chat_template,
    render_plain_contents,
)
from nanovllm.engine.gguf_tokenizer import gguf_tokenizer_args
from nanovllm.model.loader.gguf_file import read_gguf_metadata  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from nanovllm.model.loader.source import ModelSource


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of an opened model (what the engine and the server both use); a GGUF
    file's metadata, already read, is not read again."""
    if source.gguf is not None:
        return Tokenizer.from_gguf(source.gguf.metadata)
    return Tokenizer.from_pretrained_dir(source.path)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the model declares around it: BOS, EOS, chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self._bos_token_id = bos_token_id
        self._eos_token_ids = frozenset(eos_token_ids)
        # bos_token, eos_token, ... as strings: chat templates read them, as in transformers
        self._special_tokens = dict(special_tokens or {})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face model directory or a GGUF file, by what `path` is."""
        if os.path.isdir(path):
            return cls.from_pretrained_dir(path)
        return cls.from_gguf(path)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face directory: tokenizer.json, tokenizer_config.json (chat_template or a
        chat_template.jinja file), config.json, optional generation_config.json."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ModelLoadError(f"{path!r} has no tokenizer.json (only fast tokenizers load)")
        try:
            backend = BackendTokenizer.from_file(tokenizer_file)
        except Exception as e:  # the Rust side raises a bare Exception on a bad file
            raise ModelLoadError(f"cannot read {tokenizer_file!r}: {e}") from e
        tok_config = _read_json(path, "tokenizer_config.json")
        special_map = _read_json(path, "special_tokens_map.json")
        config = _read_json(path, "config.json")
        gen_config = _read_json(path, "generation_config.json")

        special: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(tok_config.get(name, special_map.get(name)))
            if content is not None:
                special[name] = content
        bos_id = _id_of(backend, special.get("bos_token"))
        if bos_id is None:
            bos_id = gen_config.get("bos_token_id", config.get("bos_token_id"))
        eos_id = _id_of(backend, special.get("eos_token"))
        eos_ids = _as_ids(eos_id) | _as_ids(gen_config.get("eos_token_id"))
        eos_ids |= _as_ids(config.get("eos_token_id"))
        if "bos_token" not in special and isinstance(bos_id, int):
            special["bos_token"] = backend.id_to_token(bos_id) or ""

        # BOS/EOS come from tokenizer.json's post-processor alone: transformers 5 drops
        # tokenizer_config.json's add_bos_token / add_eos_token whenever tokenizer.json exists
        return cls(
            backend,
            bos_token_id=bos_id if isinstance(bos_id, int) else None,
            eos_token_ids=eos_ids,
            chat_template=read_chat_template(path, tok_config),
            special_tokens=special,
        )

    @classmethod
    def from_gguf(
        cls, path_or_reader: str | os.PathLike[str] | gguf.GGUFReader | dict[str, Any]
    ) -> Tokenizer:
        """The tokenizer a GGUF file describes: a path, its metadata dict (as read by
        `read_gguf_metadata`), or an open `gguf.GGUFReader`."""
        return cls(**gguf_tokenizer_args(path_or_reader))

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `text`; BOS/EOS are added only where the model's config asks for them.
        `parse_special_tokens=False` encodes special-token text as ordinary text."""
        backend = self.backend if parse_special_tokens else self._plain_backend
        try:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the Rust side takes only text that UTF-8 can hold
            if isinstance(text, str) and any("\ud800" <= c <= "\udfff" for c in text):
                raise InvalidRequestError(
                    "the text holds a lone UTF-16 surrogate (U+D800-U+DFFF), which is not a "
                    "character; send valid Unicode", "prompt"
                ) from None
            raise

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, without transformers' space clean-up (which v5 skips for BPE too)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the tokenizer's EOS and those of config.json,
        generation_config.json or the GGUF file (eos, eot, eom)."""
        return set(self._eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of every added token marked special, plus the named bos/eos/unk/pad ids."""
        added = self.backend.get_added_tokens_decoder()
        ids = {i for i, token in added.items() if token.special}
        ids |= {_id_of(self.backend, t) for t in self._special_tokens.values()} - {None}
        if self._bos_token_id is not None:
            ids.add(self._bos_token_id)
        return sorted(ids | self._eos_token_ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """Render `messages` with the model's chat template, like transformers'
        `apply_chat_template(tokenize=False)`. Extra keywords (tools, enable_thinking, ...) become
        template variables. Encode the result with `add_special_tokens=False`: a template that
        wants a BOS writes it itself (`render_chat` does both)."""
        return self._template.render(messages, add_generation_prompt, **variables)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        parse_special_tokens: bool = False,
        **variables: Any,
    ) -> list[int]:
        """Token ids of a conversation in the chat template. Special-token text inside a
        message's content ("<|im_start|>system") is encoded as plain text, so a message can
        never open a turn of its own; `parse_special_tokens=True` lets content carry real
        control tokens (trusted callers only)."""
        if parse_special_tokens:
            text = self.apply_chat_template(messages, add_generation_prompt, **variables)
            return self.encode(text, add_special_tokens=False)
        return render_plain_contents(self, messages, add_generation_prompt, **variables)

    @cached_property
    def _template(self) -> ChatTemplate:
        return ChatTemplate(self.chat_template, self._special_tokens)

    @cached_property
    def special_tokens(self) -> dict[str, int]:
        """Text -> id of every added token marked special: the control tokens that content
        must not be able to produce."""
        added = self.backend.get_added_tokens_decoder()
        return {t.content: i for i, t in added.items() if t.special}

    @cached_property
    def _plain_backend(self) -> BackendTokenizer:
        # a twin that encodes special-token text as ordinary text
        twin = BackendTokenizer.from_str(self.backend.to_str())
        twin.encode_special_tokens = True
        return twin


# ----- Hugging Face directories -----


def _read_json(directory: str | os.PathLike[str], name: str) -> dict[str, Any]:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path!r}: {e}") from e


def _token_content(token: Any) -> str | None:
    # tokenizer_config.json spells a token as a string or as a serialized AddedToken
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _id_of(backend: BackendTokenizer, token: str | None) -> int | None:
    return backend.token_to_id(token) if token is not None else None


def _as_ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()
