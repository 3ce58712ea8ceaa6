"""OpenAI tool calling: checking a request's `tools` and `tool_choice`, and the JSON schema
that forces a call when `tool_choice` demands one, with its output read back as calls.

Two ways a call comes out of the model. Forced ("required" or a named function): the grammar
engine holds the output to `forced_call_schema`, so it is JSON of a known shape and
`parse_forced_calls` reads it. Free ("auto"): the model writes calls in its own format, which
a `ToolCallParser` (engine/tool_parsers.py) finds: hermes (Qwen, Hermes:
`<tool_call>{...}</tool_call>` blocks) or llama3_json (Llama 3.x: the whole answer is
`{"name": ..., "parameters": {...}}`).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from nanovllm.core.errors import InvalidRequestError

MAX_TOOLS = 128  # OpenAI's limit

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NAME_RULE = "a non-empty string of letters, digits, _ and - (at most 64)"
_CHOICES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass
class ToolCall:
    """One call the model made. `arguments` is JSON text, as OpenAI sends it (clients
    `json.loads` it themselves), not a dict."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict:
        """The call as an entry of a message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# ---------------------------------------------------------------------------------------------
# the request: tools and tool_choice


def check_tools(tools: list | None) -> list[dict]:
    """The `function` of each of a request's OpenAI `tools`, checked and normalized (a
    function without `parameters` takes an empty object). InvalidRequestError (a ValueError)
    names the field that is wrong, so the client knows what to change; checked before
    anything is scheduled because a bad schema would otherwise fail deep in the grammar
    engine, or a duplicate name make calls ambiguous."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _tools_error("tools must be a list of {\"type\": \"function\", \"function\": ...}")
    if len(tools) > MAX_TOOLS:
        raise _tools_error(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    functions: list[dict] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _tools_error(f"{where} must be an object")
        if tool.get("type") != "function":
            raise _tools_error(f'{where}.type must be "function"')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _tools_error(f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _tools_error(f"{where}.function.name must be {_NAME_RULE}")
        if name in seen:
            raise _tools_error(f'{where}.function.name "{name}" repeats tools[{seen[name]}]')
        seen[name] = i
        checked = {"name": name}
        description = function.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise _tools_error(f"{where}.function.description must be a string")
            checked["description"] = description
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}  # no arguments
        elif not isinstance(parameters, dict):
            raise _tools_error(f"{where}.function.parameters must be a JSON schema object")
        elif parameters.get("type", "object") != "object":
            raise _tools_error(
                f'{where}.function.parameters.type must be "object": a function\'s arguments '
                "are a JSON object"
            )
        checked["parameters"] = parameters
        strict = function.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise _tools_error(f"{where}.function.strict must be true or false")
            checked["strict"] = strict
        functions.append(checked)
    return functions


def check_tool_choice(choice, tools: list | None) -> str | dict:
    """The request's `tool_choice`, checked against its tools (check_tools' functions, or
    the raw `tools`): "none", "auto", "required" or `{"type": "function", "function":
    {"name": N}}`. Left out, it is "auto" when there are tools and "none" when there are not,
    as OpenAI does; "auto" without tools is "none" too, since there is nothing to call (some
    clients always send it). "required" or a name without tools cannot be met: an error."""
    names = _names(tools)
    if choice is None:
        return "auto" if names else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not names:
            raise _choice_error(
                'tool_choice "required" needs tools; send tools, or choose "none" or "auto"'
            )
        return choice if names else "none"
    if not isinstance(choice, dict):
        raise _choice_error(f"tool_choice must be {_CHOICES}; got {choice!r}")
    if choice.get("type") != "function":
        raise _choice_error('tool_choice.type must be "function"')
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise _choice_error(
            'tool_choice.function must be {"name": ...} with the name of one of the tools'
        )
    if name not in names:
        listed = ", ".join(f'"{n}"' for n in names) or "none were sent"
        raise _choice_error(
            f'tool_choice names function "{name}", which is not among tools ({listed}); '
            'send it in tools, or choose "auto"'
        )
    return {"type": "function", "function": {"name": name}}


def _names(tools: list | None) -> list[str]:
    """The function names of check_tools' output or of raw `tools`."""
    names = []
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def _tools_error(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="tools")


def _choice_error(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="tool_choice")


# ---------------------------------------------------------------------------------------------
# forced calls: tool_choice "required" or a named function


def forced_call_schema(functions: list[dict], choice: str | dict, parallel: bool) -> dict:
    """The JSON schema the grammar engine holds the output to when `choice` forces a call.

    Named function: its parameters schema, so the output is the arguments object itself and
    the model cannot pick another function. "required": an array of `{"name", "parameters"}`
    objects, one alternative per tool, with at least one item and, unless `parallel`
    (OpenAI's `parallel_tool_calls`), at most one. `additionalProperties: false` keeps the
    model from writing keys that `parse_forced_calls` would drop."""
    if isinstance(choice, dict):
        return _function(functions, choice["function"]["name"])["parameters"]
    if choice != "required":
        raise ValueError(f"tool_choice {choice!r} forces no call: there is no schema for it")
    schema: dict = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        "parameters": f["parameters"],
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for f in functions
            ]
        },
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_forced_calls(text: str, functions: list[dict], choice: str | dict) -> list[ToolCall]:
    """The calls in an output `forced_call_schema` constrained. ValueError when the text is
    not whole JSON of that shape: the grammar allows nothing else, so the output was cut
    short (by max_tokens, a stop string, or an abort)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(
            f"the forced tool call is not complete JSON (cut short by max_tokens?): {e}"
        ) from None
    if isinstance(choice, dict):
        name = _function(functions, choice["function"]["name"])["name"]
        if not isinstance(value, dict):
            raise ValueError(f"the forced call's arguments are not a JSON object: {text!r}")
        return [ToolCall(name, dumps_arguments(value))]
    if choice != "required":
        raise ValueError(f"tool_choice {choice!r} forces no call")
    names = {f["name"] for f in functions}
    if not isinstance(value, list) or not value:
        raise ValueError(f"the forced calls are not a non-empty JSON array: {text!r}")
    calls = []
    for item in value:
        if (
            not isinstance(item, dict)
            or item.get("name") not in names
            or not isinstance(item.get("parameters"), dict)
        ):
            raise ValueError(f"a forced call is not {{name of a tool, parameters}}: {item!r}")
        calls.append(ToolCall(item["name"], dumps_arguments(item["parameters"])))
    return calls


def _function(functions: list[dict], name: str) -> dict:
    for f in functions:
        if f["name"] == name:
            return f
    raise ValueError(f"no function {name!r} among the tools")


def dumps_arguments(arguments: dict) -> str:
    """Arguments as OpenAI sends them: compact-ish JSON, non-ASCII text kept as is."""
    return json.dumps(arguments, ensure_ascii=False)
