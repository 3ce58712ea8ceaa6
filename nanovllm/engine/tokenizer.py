"""Text <-> token ids and chat templates, from a Hugging Face model directory or a GGUF file.

Runtime needs only `tokenizers`, `jinja2` and `gguf`: importing `transformers` costs seconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

import gguf
import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from nanovllm.core.errors import InvalidRequestError, ModelLoadError
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


class ChatTemplateError(InvalidRequestError):
    """The model has no chat template, or the messages are malformed or rejected by it."""


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
            chat_template=_read_chat_template(path, tok_config),
            special_tokens=special,
        )

    @classmethod
    def from_gguf(
        cls, path_or_reader: str | os.PathLike[str] | gguf.GGUFReader | dict[str, Any]
    ) -> Tokenizer:
        """The tokenizer a GGUF file describes: a path, its metadata dict (as read by
        `read_gguf_metadata`), or an open `gguf.GGUFReader`."""
        return cls(**gguf_tokenizer_args(path_or_reader))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS are added only where the model's config asks for them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

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
        wants a BOS writes it itself."""
        _check_messages(messages)
        template = self._compiled_template
        context = {"tools": None, "documents": None, **self._special_tokens, **variables}
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            # raise_exception() in a template reports a malformed conversation
            message = f"the chat template rejected the messages: {e}"
            raise ChatTemplateError(message, "messages") from e

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template; send a plain prompt instead of messages",
                "messages",
            )
        try:
            return _template_env().from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"the model's chat template does not compile: {e}") from e


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


def _read_chat_template(
    directory: str | os.PathLike[str], tok_config: dict[str, Any]
) -> str | None:
    # chat_template.jinja wins over tokenizer_config.json's entry, as in transformers
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ----- GGUF files -----

# ----- chat templates -----


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (marks assistant text for
    training masks): render the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_env() -> ImmutableSandboxedEnvironment:
    # a chat template is untrusted code shipped with the model: sandbox it, options as transformers
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content}", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            kind = type(message).__name__
            raise ChatTemplateError(f"messages[{i}] must be an object, not {kind}", "messages")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}].role must be a string", "messages")
        if not isinstance(message.get("content"), str | list | None):
            raise ChatTemplateError(
                f"messages[{i}].content must be a string, a list of parts or null", "messages"
            )
