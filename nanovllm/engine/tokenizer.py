"""Text <-> token ids and chat templates, from a Hugging Face model directory or a GGUF file.

Runtime needs only `tokenizers`, `jinja2` and `gguf`: importing `transformers` costs seconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import cached_property
from typing import Any

import gguf
import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from nanovllm.core.errors import InvalidRequestError, ModelLoadError
from nanovllm.model.loader.gguf_file import read_gguf_metadata


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
        meta = _gguf_metadata(path_or_reader)
        model = meta("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer.ggml.model={model!r} is not supported; "
                "only 'gpt2' (byte-level BPE) is"
            )
        tokens: list[str] = meta("tokenizer.ggml.tokens") or []
        types: list[int] = meta("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ModelLoadError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
        pre = meta("tokenizer.ggml.pre") or "default"
        kind = _PRE_TOKENIZERS.get(pre)
        if kind is None:
            known = sorted(_PRE_TOKENIZERS)
            raise ModelLoadError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported ({known})")

        def token_id(name: str) -> int | None:
            value = meta(f"tokenizer.ggml.{name}_token_id")
            return value if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos_id, eos_id = token_id("bos"), token_id("eos")
        add_bos = meta("tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp's default: BOS for llama3-style vocabularies only
            add_bos = kind == _LLAMA3_REGEX
        add_eos = meta("tokenizer.ggml.add_eos_token")
        post = _post_processor(
            [(tokens[bos_id], bos_id)] if add_bos and bos_id is not None else [],
            [(tokens[eos_id], eos_id)] if add_eos and eos_id is not None else [],
        )
        merges = meta("tokenizer.ggml.merges") or []
        backend = _byte_level_bpe(tokens, types, merges, kind, post)
        names = {
            "bos_token": "bos",
            "eos_token": "eos",
            "unk_token": "unknown",
            "pad_token": "padding",
        }
        special = {n: tokens[i] for n, key in names.items() if (i := token_id(key)) is not None}
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids={i for i in map(token_id, ("eos", "eot", "eom")) if i is not None},
            chat_template=meta("tokenizer.chat_template"),
            special_tokens=special,
        )

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

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp's token types

# llama.cpp's pre-tokenizer by `tokenizer.ggml.pre` (llama-vocab.cpp), as HF pre-tokenizers
_GPT2 = "gpt2"  # GPT-2's regex, which ByteLevel(use_regex=True) applies
_DIGITS_GPT2 = "digits+gpt2"  # every digit alone, then GPT-2's regex
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_TOKENIZERS: dict[str, str] = {
    # a file with no pre name gets llama.cpp's legacy "default" splits, which llama.cpp warns
    # degrade output; GPT-2's regex is what such vocabularies were trained with
    **dict.fromkeys(("default", "gpt2", "mpt", "olmo", "jais"), _GPT2),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        _DIGITS_GPT2,
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_REGEX
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2_REGEX),
}


def _gguf_metadata(path_or_reader: Any) -> Callable[[str], Any]:
    """A `key -> value or None` lookup over a GGUF file's metadata."""
    if isinstance(path_or_reader, dict):
        return path_or_reader.get
    if not isinstance(path_or_reader, gguf.GGUFReader):
        return read_gguf_metadata(path_or_reader).get
    fields = path_or_reader.fields

    def meta(key: str) -> Any:
        field = fields.get(key)
        try:
            return field.contents() if field is not None else None
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"GGUF metadata {key!r} is not valid UTF-8: {e}") from e

    return meta


def _pre_tokenizer(kind: str) -> dict[str, Any]:
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": kind in (_GPT2, _DIGITS_GPT2),
    }
    if kind == _GPT2:
        return byte_level
    if kind == _DIGITS_GPT2:
        first = {"type": "Digits", "individual_digits": True}
    else:
        first = {
            "type": "Split",
            "pattern": {"Regex": kind},
            "behavior": "Isolated",
            "invert": False,
        }
    return {"type": "Sequence", "pretokenizers": [first, byte_level]}


def _post_processor(
    head: list[tuple[str, int]], tail: list[tuple[str, int]]
) -> dict[str, Any] | None:
    """tokenizer.json's TemplateProcessing: each sequence between `head` and `tail` tokens."""
    if not head and not tail:
        return None

    def template(seq: str, type_id: int) -> list[dict[str, Any]]:
        def special(tokens: list[tuple[str, int]]) -> list[dict[str, Any]]:
            return [{"SpecialToken": {"id": t, "type_id": type_id}} for t, _ in tokens]

        return [*special(head), {"Sequence": {"id": seq, "type_id": type_id}}, *special(tail)]

    return {
        "type": "TemplateProcessing",
        "single": template("A", 0),
        "pair": template("A", 0) + template("B", 1),
        "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in head + tail},
    }


def _byte_level_bpe(
    tokens: list[str],
    types: list[int],
    merges: list[str],
    pre_kind: str,
    post_processor: dict[str, Any] | None,
) -> BackendTokenizer:
    """Byte-level BPE, built as tokenizer.json text: faster than adding tokens one by one."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated spelling keeps its first id
    # control tokens are special (skipped by decode); user-defined ones are matched whole too
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind == _CONTROL,
        }
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        # llama.cpp looks a whole llama3 word up before merging: HF's ignore_merges
        "ignore_merges": pre_kind == _LLAMA3_REGEX,
        "vocab": vocab,
        "merges": _merge_pairs(merges),
    }
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(pre_kind),
        "post_processor": post_processor,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": model,
    }
    return BackendTokenizer.from_str(json.dumps(spec))


def _merge_pairs(merges: list[str]) -> list[str] | list[list[str]]:
    # "left right" strings parse fastest as they are; split only if a token holds a space,
    # at the first space after position 0 as llama.cpp does
    if all(m.count(" ") == 1 for m in merges):
        return merges
    return [[m[: (j := m.find(" ", 1))], m[j + 1 :]] for m in merges]


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
