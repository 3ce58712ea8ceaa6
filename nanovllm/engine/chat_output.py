"""A chat reply's text as OpenAI's message parts, whole or as it streams: the reasoning
(engine/reasoning.py), the content, and the tool calls in the content (engine/tool_calls.py).
`LLM.chat` and the OpenAI server's chat completions both read replies through here.

How a request asks for tools decides how its calls are read:
- tool_choice "required" or a named function: the engine's grammar forced the answer into
  `forced_call_schema`, so the whole answer is the calls (read at the end);
- "auto": the model's own format, found by the tool-call parser (hermes, llama3_json);
- "none", or no tools: the answer is all content.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.engine.reasoning import ReasoningParser, ReasoningStream
from nanovllm.engine.tool_calls import (
    ToolCall,
    check_tool_choice,
    check_tools,
    forced_call_schema,
    parse_forced_calls,
)
from nanovllm.engine.tool_parsers import ToolCallParser, ToolCallStream


@dataclass
class ChatReply:
    """A reply's parts (whole) or the parts one piece of it made certain (streamed)."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, later: ChatReply) -> ChatReply:
        """This piece followed by a `later` one."""
        return ChatReply(_join(self.reasoning, later.reasoning),
                         _join(self.content, later.content), self.tool_calls + later.tool_calls)


def _join(a: str | None, b: str | None) -> str | None:
    return b if a is None else a if b is None else a + b


class ChatTools:
    """One request's `tools`, `tool_choice` and `parallel_tool_calls`, checked (errors name
    the field), and what they ask of the engine."""

    def __init__(self, tools: list | None, tool_choice=None, parallel: bool = True,
                 parser: str | None = None) -> None:
        self.functions = check_tools(tools)
        self.choice = check_tool_choice(tool_choice, tools)
        self.parallel = parallel
        self.parser = parser
        if self.choice == "auto" and parser is None:
            raise InvalidRequestError(
                'tool_choice "auto" needs a tool-call parser, and this model\'s chat template '
                "shows no format the engine knows: start it with tool_call_parser (--tool-call-"
                'parser) hermes or llama3_json, or use tool_choice "required" or a named '
                "function", "tool_choice")

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates read them (OpenAI's shape)."""
        if not self.functions:
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the grammar that forces the calls, when the choice forces them."""
        if not self.forced:
            return params
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                "tool_choice forces a tool call, which is itself a structured output: drop "
                "response_format / structured_outputs, or use tool_choice \"auto\"",
                "tool_choice")
        schema = forced_call_schema(self.functions, self.choice, self.parallel)
        # compact JSON: no whitespace between tokens, which a model could write without end
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                     param="tool_choice")
        return dataclasses.replace(params, structured_outputs=so)


class ChatOutputParser:
    """Reads replies of one request: `parse` a whole reply, `stream` one that arrives in
    pieces (the pieces' reasoning and content joined, and their calls, equal `parse`'s)."""

    def __init__(self, reasoning: str | None = None, tools: ChatTools | None = None) -> None:
        self.reasoning = ReasoningParser(reasoning) if reasoning else None
        self.tools = tools if tools is not None and tools.choice != "none" else None

    def parse(self, text: str) -> ChatReply:
        """A whole reply: one piece of a stream, so both read it one way."""
        stream = self.stream()
        return stream.feed(text) + stream.finish()

    def stream(self) -> ChatReplyStream:
        return ChatReplyStream(self)


class ChatReplyStream:
    """`ChatOutputParser.parse` a piece at a time. Forced calls come whole at `finish`;
    auto calls as each one completes."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self._reasoning: ReasoningStream | None = (
            parser.reasoning.stream() if parser.reasoning is not None else None)
        tools = parser.tools
        self._forced = tools is not None and tools.forced
        self._calls: ToolCallStream | None = (
            ToolCallParser(tools.parser).stream() if tools is not None and not self._forced
            else None)
        self._held: list[str] = []  # a forced answer, read whole at the end

    def feed(self, delta: str) -> ChatReply:
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(delta)
        else:
            reasoning, content = "", delta
        return self._answer(reasoning, content, final=False)

    def finish(self) -> ChatReply:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._answer(reasoning, content, final=True)

    def _answer(self, reasoning: str, content: str, final: bool) -> ChatReply:
        reply = ChatReply(reasoning or None)
        if self._forced:
            self._held.append(content)
            answer = "".join(self._held) if final else ""
            if answer:
                reply.content, reply.tool_calls = self._forced_calls(answer)
            return reply
        if self._calls is not None:
            text, calls = self._calls.feed(content) if content else ("", [])
            if final:
                rest, more = self._calls.finish()
                text, calls = text + rest, calls + more
            reply.content, reply.tool_calls = text or None, calls
            return reply
        reply.content = content or None
        return reply

    def _forced_calls(self, answer: str) -> tuple[str | None, list[ToolCall]]:
        tools = self.parser.tools
        try:
            return None, parse_forced_calls(answer, tools.functions, tools.choice)
        except ValueError:  # cut short (max_tokens): the text is all there is
            return answer, []


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's `tool_calls` arrive from OpenAI
    clients with `function.arguments` as JSON text, and templates (Qwen's, Llama's) write
    them with `tojson`, so they get the object (text that is not JSON stays text)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls and isinstance(calls, list):
            m = dict(m, tool_calls=[_call_for_template(c) for c in calls])
        out.append(m)
    return out


def _call_for_template(call):
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    return dict(call, function=dict(fn, arguments=arguments))
