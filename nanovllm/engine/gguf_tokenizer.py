"""Byte-level BPE tokenizers from GGUF metadata, split as llama.cpp splits each vocabulary."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import gguf
from tokenizers import Tokenizer as BackendTokenizer

from nanovllm.core.errors import ModelLoadError
from nanovllm.model.loader.gguf_file import read_gguf_metadata

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


def gguf_tokenizer_args(path_or_reader: Any) -> dict[str, Any]:
    """`Tokenizer(**args)` for the tokenizer a GGUF file describes: a path, its metadata dict,
    or an open `gguf.GGUFReader`."""
    meta = _gguf_metadata(path_or_reader)
    model = meta("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer.ggml.model={model!r} is not supported; only 'gpt2' (byte-level BPE) is"
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
    return dict(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_ids={i for i in map(token_id, ("eos", "eot", "eom")) if i is not None},
        chat_template=meta("tokenizer.chat_template"),
        special_tokens=special,
    )
