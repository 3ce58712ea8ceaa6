"""Tool calls a model writes in its own format (tool_choice "auto"), found in its text whole
or as it streams: hermes (`<tool_call>{...}</tool_call>` blocks, as Qwen and Hermes write
them) and llama3_json (Llama 3.x: the whole answer is `{"name": ..., "parameters": {...}}`).
engine/tool_calls.py holds the calls themselves and the forced kind."""

from __future__ import annotations

import json

from nanovllm.core.config import TOOL_CALL_PARSERS as CONFIG_PARSERS
from nanovllm.engine.tool_calls import ToolCall, dumps_arguments

# the formats a model writes its calls in (core/config.py's tool_call_parser, less "auto")
TOOL_CALL_PARSERS = tuple(p for p in CONFIG_PARSERS if p != "auto")


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolCallParser:
    """Finds the calls a model wrote in its own format, and the content around them.

    hermes: each `<tool_call>...</tool_call>` block holding `{"name": str, "arguments":
    object}` ("parameters" is accepted for "arguments") is a call; a block that holds
    anything else stays in the content, as text, so nothing the model wrote is lost. An
    output cut inside its last block still gives that call if what was written parses.

    llama3_json: the output is calls only when, after leading whitespace (and an optional
    `<|python_tag|>`), all of it is one `{"name": str, "parameters": object}` or several
    separated by `;`; otherwise all of it is content. Llama answers either with a call or
    with text, never both.
    """

    def __init__(self, kind: str) -> None:
        if kind not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {kind!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}"
            )
        self.kind = kind

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output: the content is the text outside the calls,
        without the whitespace around it, None when nothing is left. The whole output is one
        piece of a stream: one way to read it, however it comes."""
        stream = self.stream()
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        return (content + rest) or None, calls + more

    def stream(self) -> ToolCallStream:
        """A parser for one output that arrives in pieces."""
        return _HermesStream() if self.kind == "hermes" else _Llama3Stream()


def _hermes_call(inner: str) -> ToolCall | None:
    """The call a hermes block holds, or None. Without "arguments" the call has none: a
    function of no parameters, and the tags leave no doubt the model meant a call."""
    try:
        obj = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    return _call_from(obj, arguments_required=False)


def _call_from(obj, arguments_required: bool) -> ToolCall | None:
    """A call from `{"name": str, "arguments" | "parameters": object}`, or None. Arguments
    given as JSON text (OpenAI's own form, which some models copy) are read too."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if "arguments" in obj:
        arguments = obj["arguments"]
    elif "parameters" in obj:
        arguments = obj["parameters"]
    elif arguments_required:
        return None
    else:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], dumps_arguments(arguments))


def _llama3_body(head: str) -> str | None:
    """`head` (the output from its first non-space) less an opening `<|python_tag|>` and
    the whitespace after it; None while `head` may still be a cut-off `<|python_tag|>`."""
    if head.startswith(PYTHON_TAG):
        return head[len(PYTHON_TAG) :].lstrip()
    if PYTHON_TAG.startswith(head):
        return None
    return head


_DONE, _OPEN, _BAD = "done", "open", "bad"


def _scan_llama3(
    body: str, pos: int, calls: list[ToolCall], after_call: bool = False
) -> tuple[int, bool, str]:
    """Reads `{call} ; {call} ...` from `pos` (just after a call when `after_call`),
    appending each call to `calls`. Gives where a later scan resumes (after the last whole
    call or `;`) with its `after_call`, and whether the text is a whole call sequence (done:
    an ending `;` allowed), may still become one (open), or cannot (bad). Once bad, more text
    never makes it good: a JSON object ends at its own closing brace, so an object read from
    a cut-off output is the one the whole output holds."""
    decoder = json.JSONDecoder()
    while True:
        at = _skip_space(body, pos)
        if at == len(body):
            return pos, after_call, _DONE if calls else _OPEN
        if after_call:
            if body[at] != ";":
                return pos, after_call, _BAD
            pos, after_call = at + 1, False
            continue
        if body[at] != "{":
            return pos, after_call, _BAD
        try:
            obj, end = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return pos, after_call, _OPEN  # cut off, or broken: only the end of the output tells
        call = _call_from(obj, arguments_required=True)
        if call is None:
            return pos, after_call, _BAD
        calls.append(call)
        pos, after_call = end, True


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


# ---------------------------------------------------------------------------------------------
# streaming


class ToolCallStream:
    """`ToolCallParser.parse` one piece at a time. The content pieces joined are exactly
    `parse`'s content ("" for None), and the calls, in order, its calls (same names and
    arguments; ids are new), however the output is cut. Text that may still turn out to be
    a call waits for the next piece, or for `finish`; so does whitespace that may be the
    output's last, which `parse` strips (the content never begins or ends with whitespace).
    """

    def __init__(self) -> None:
        self._held = ""  # text not yet known to be content or a call
        self._started = False  # content given out (or held) already: no more leading space
        self._space = ""  # whitespace at the end of the content so far, not given out yet

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content this piece makes certain, calls it completes)."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content, calls) still held back, at the end of the output."""
        raise NotImplementedError

    def _content(self, text: str) -> str:
        """Content as `parse` gives it: no whitespace before the first text, and trailing
        whitespace only once more text follows it."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        out, self._space = self._space + body, text[len(body) :]
        return out


class _HermesStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._searched = 0  # where in a held block `</tool_call>` was looked for up to

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        text, self._held = self._held + delta, ""
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(HERMES_OPEN, pos)
            if start < 0:
                keep = _partial_tag(text, HERMES_OPEN, pos)
                content.append(text[pos : len(text) - keep])
                self._held, self._searched = text[len(text) - keep :], 0
                break
            content.append(text[pos:start])
            inner = start + len(HERMES_OPEN)
            close = text.find(HERMES_CLOSE, max(inner, start + self._searched))
            if close < 0:  # inside a block: wait for its end
                self._held = text[start:]
                self._searched = max(len(HERMES_OPEN), len(self._held) - len(HERMES_CLOSE) + 1)
                break
            self._searched = 0
            end = close + len(HERMES_CLOSE)
            call = _hermes_call(text[inner:close])
            if call is None:
                content.append(text[start:end])
            else:
                calls.append(call)
            pos = end
        return self._content("".join(content)), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._held = self._held, ""
        calls: list[ToolCall] = []
        if text.startswith(HERMES_OPEN):  # cut inside its last block
            call = _hermes_call(text[len(HERMES_OPEN) :])
            if call is not None:
                calls.append(call)
                text = ""
        return self._content(text), calls


class _Llama3Stream(ToolCallStream):
    _HEAD, _JSON, _CONTENT = range(3)

    def __init__(self) -> None:
        super().__init__()
        self._state = self._HEAD
        self._body = 0  # where the JSON begins in the held text
        self._scanned, self._after_call = 0, False  # where in the JSON the next scan resumes
        self._calls: list[ToolCall] = []  # calls read so far, given out only at the end

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self._state == self._CONTENT:
            return self._content(delta), []
        self._held += delta
        if self._state == self._HEAD:
            head = self._held.lstrip()
            body = _llama3_body(head)
            if not body:  # only space so far, or a `<|python_tag|>` maybe cut
                return "", []
            if not body.startswith("{"):
                return self._give_up(), []
            self._state, self._body = self._JSON, len(self._held) - len(body)
        state = self._scan()
        if state == _BAD:
            return self._give_up(), []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._state == self._JSON and self._scan() == _DONE:
            self._held = ""
            return "", self._calls
        return (self._give_up() if self._state != self._CONTENT else ""), []

    def _scan(self) -> str:
        """Reads the JSON on from where the last piece's scan stopped."""
        body = self._held[self._body :]
        self._scanned, self._after_call, state = _scan_llama3(
            body, self._scanned, self._calls, self._after_call
        )
        return state

    def _give_up(self) -> str:
        """The output is not calls: all of it is content."""
        self._state, self._calls = self._CONTENT, []
        text, self._held = self._held, ""
        return self._content(text)


def _partial_tag(text: str, tag: str, start: int = 0) -> int:
    """Length of the longest end of `text[start:]` that is a proper beginning of `tag`:
    characters a stream holds back because the next piece may complete the tag."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# ---------------------------------------------------------------------------------------------
# which parser a model needs

_LLAMA3_MARKS = ("<|python_tag|>", "<|eom_id|>", "Environment: ipython", '"parameters": dict')


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The tool call parser a chat template's prompt teaches the model, or None when the
    template shows no tool format this module knows. hermes: the template shows calls in
    `<tool_call>` tags (Qwen 2.5 and 3, Hermes). llama3_json: Llama 3.x's tool prompt
    (`<|python_tag|>`, `<|eom_id|>`, "Environment: ipython", or its `{"name": function name,
    "parameters": dictionary ...}` instruction)."""
    if not chat_template:
        return None
    if HERMES_OPEN in chat_template:
        return "hermes"
    if any(mark in chat_template for mark in _LLAMA3_MARKS):
        return "llama3_json"
    return None
