"""Chat templates: the model's Jinja template, run in a sandbox, and conversations rendered
to token ids with each message's content as plain text.

Why plain text: a template writes control tokens ("<|im_start|>system") around each message,
and tokenizing the rendered text would turn the same characters inside a message into the
same control tokens, so a user could open a system turn of their own. `render_plain_contents`
keeps every control token the template wrote and encodes the contents' special-token text as
ordinary text.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanovllm.core.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BackendTokenizer

# a content's special-token text stands in the template's input as MARK_OPEN index MARK_CLOSE
# (private-use characters: no template treats them specially, no tokenizer merges them away)
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")


class ChatTemplateError(InvalidRequestError):
    """The model has no chat template, or the messages are malformed or rejected by it."""


class ChatTemplate:
    """A model's chat template, compiled once, rendered like transformers'
    `apply_chat_template(tokenize=False)`."""

    def __init__(self, source: str | None, special_tokens: dict[str, str]) -> None:
        if not source:
            self._template = None
        else:
            try:
                self._template = _template_env().from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ModelLoadError(f"the model's chat template does not compile: {e}") from e
        self._special_tokens = special_tokens  # bos_token, eos_token, ... as template variables

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template; send a plain prompt instead of messages",
                "messages",
            )
        _check_messages(messages)
        context = {"tools": None, "documents": None, **self._special_tokens, **variables}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            # raise_exception() in a template reports a malformed conversation
            message = f"the chat template rejected the messages: {e}"
            raise ChatTemplateError(message, "messages") from e


class ChatTokenizer(Protocol):
    """What `render_plain_contents` asks of a tokenizer: engine/tokenizer.py's Tokenizer,
    which calls it from `render_chat`, so this module stays below the tokenizer."""

    backend: BackendTokenizer  # its encodings carry offsets
    special_tokens: dict[str, int]  # text -> id of every added token marked special

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, **variables: Any
    ) -> str: ...

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special_tokens: bool = True
    ) -> list[int]: ...


def render_plain_contents(
    tokenizer: ChatTokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
    **variables: Any,
) -> list[int]:
    """Token ids of the rendered conversation, with every special token a message's content
    spells encoded as plain text and every one the template wrote kept.

    Each special-token string in a content is replaced by a marker before rendering; in the
    rendered text the markers are put back and their spans noted. The text is then split at
    the special tokens the tokenizer finds outside those spans (the template's), as the
    tokenizer itself splits at special tokens, and each piece between them is encoded with
    special-token text as ordinary text.
    """
    specials = tokenizer.special_tokens
    pattern = _specials_pattern(tuple(specials))
    originals: list[str] = []

    def hide(text: str) -> str:
        def mark(m: re.Match) -> str:
            originals.append(m.group(0))
            return f"{MARK_OPEN}{len(originals) - 1}{MARK_CLOSE}"

        return pattern.sub(mark, text) if pattern is not None else text

    hidden = [_map_content(m, hide) for m in messages] if isinstance(messages, list) else messages
    rendered = tokenizer.apply_chat_template(hidden, add_generation_prompt, **variables)
    if not originals:  # nothing to hide: the usual case
        return tokenizer.encode(rendered, add_special_tokens=False)
    text, spans = _unhide(rendered, originals)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    special_ids = set(specials.values())

    def plain(start: int, end: int) -> list[int]:
        piece = text[start:end]
        return tokenizer.encode(piece, add_special_tokens=False, parse_special_tokens=False)

    ids: list[int] = []
    piece_start = piece_end = None  # the text since the last template special token
    for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
        if token_id in special_ids and not _inside(start, end, spans):
            if piece_start is not None:
                ids += plain(piece_start, piece_end)
            ids.append(token_id)
            piece_start = piece_end = None
        else:
            piece_start = start if piece_start is None else min(piece_start, start)
            piece_end = end if piece_end is None else max(piece_end, end)
    if piece_start is not None:
        ids += plain(piece_start, piece_end)
    return ids


def _specials_pattern(specials: tuple[str, ...]) -> re.Pattern | None:
    if not specials:
        return None
    # longest first, so a token that contains another is matched whole
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


def _map_content(message: Any, fn) -> Any:
    """The message with `fn` applied to its text content (a string or text parts)."""
    if not isinstance(message, dict):
        return message  # _check_messages reports it
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": fn(content)}
    if isinstance(content, list):
        parts = [
            {**p, "text": fn(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
        return {**message, "content": parts}
    return message


def _unhide(rendered: str, originals: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text with the markers put back, and where each one now stands."""
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    length = last = 0
    for m in _MARK.finditer(rendered):
        out.append(rendered[last : m.start()])
        length += m.start() - last
        original = originals[int(m.group(1))]
        out.append(original)
        spans.append((length, length + len(original)))
        length += len(original)
        last = m.end()
    out.append(rendered[last:])
    return "".join(out), spans


def _inside(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    return any(s < end and start < e for s, e in spans)


def read_chat_template(
    directory: str | os.PathLike[str], tok_config: dict[str, Any]
) -> str | None:
    """A Hugging Face directory's chat template: chat_template.jinja wins over
    tokenizer_config.json's entry, as in transformers."""
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


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
