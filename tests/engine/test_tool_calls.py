"""Tool calling (nanovllm/engine/tool_calls.py): a request's tools and tool_choice checked
with errors that name the field, the schema that forces a call and its output read back,
and the model's own call formats parsed whole and streamed, the stream agreeing with the
whole parse however the output is cut."""

import itertools
import json
import random

import pytest

from nanovllm.core.errors import InvalidRequestError
from nanovllm.engine.tool_calls import (
    ToolCall,
    check_tool_choice,
    check_tools,
    forced_call_schema,
    parse_forced_calls,
)
from nanovllm.engine.tool_parsers import (
    TOOL_CALL_PARSERS,
    ToolCallParser,
    detect_tool_call_parser,
)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}


def tool(name, **function):
    return {"type": "function", "function": {"name": name, **function}}


TOOLS = [
    tool("get_weather", description="Weather in a city", parameters=WEATHER_PARAMS),
    tool("get_time"),
]


def pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ------------------------------------------------------------------------------ ToolCall


def test_tool_call_to_openai():
    call = ToolCall("get_weather", '{"city": "Paris"}')
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24
    assert ToolCall("f", "{}").id != call.id
    assert call.to_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert ToolCall("f", "{}", id="call_x").to_openai()["id"] == "call_x"


# ------------------------------------------------------------------------------ check_tools


def test_check_tools_normalizes():
    functions = check_tools(TOOLS + [tool("strict_one", parameters=WEATHER_PARAMS, strict=True)])
    assert functions == [
        {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS},
        {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        {"name": "strict_one", "parameters": WEATHER_PARAMS, "strict": True},
    ]
    assert check_tools([]) == [] and check_tools(None) == []
    # each default is its own dict: changing one changes no other
    a, b = check_tools([tool("a"), tool("b")])
    a["parameters"]["properties"]["x"] = {}
    assert b["parameters"] == {"type": "object", "properties": {}}
    assert check_tools([tool("n", parameters=None, description=None)]) == [
        {"name": "n", "parameters": {"type": "object", "properties": {}}}
    ]


@pytest.mark.parametrize(
    "tools, message",
    [
        ({"type": "function"}, "tools must be a list"),
        (["get_weather"], "tools[0] must be an object"),
        ([{"function": {"name": "f"}}], 'tools[0].type must be "function"'),
        ([TOOLS[0], {"type": "code_interpreter"}], 'tools[1].type must be "function"'),
        ([{"type": "function"}], "tools[0].function must be an object"),
        ([{"type": "function", "function": {}}], "tools[0].function.name must be a non-empty"),
        (TOOLS + [tool("has space")], "tools[2].function.name must be a non-empty string of "
         "letters, digits, _ and - (at most 64)"),
        ([tool("")], "tools[0].function.name must be"),
        ([tool("x" * 65)], "tools[0].function.name must be"),
        ([tool(7)], "tools[0].function.name must be"),
        ([tool("dé")], "tools[0].function.name must be"),
        ([tool("a\n")], "tools[0].function.name must be"),
        ([tool("f", description=3)], "tools[0].function.description must be a string"),
        ([tool("f"), tool("g", parameters=[])],
         "tools[1].function.parameters must be a JSON schema object"),
        ([tool("f", parameters="{}")], "tools[0].function.parameters must be a JSON schema"),
        ([tool("f", parameters={"type": "string"})],
         'tools[0].function.parameters.type must be "object"'),
        ([tool("f", strict="yes")], "tools[0].function.strict must be true or false"),
        ([tool("x"), tool("y"), tool("z"), tool("x")],
         'tools[3].function.name "x" repeats tools[0]'),
        ([tool(f"f{i}") for i in range(129)], "tools holds 129 tools; at most 128"),
    ],
)
def test_check_tools_errors_name_the_field(tools, message):
    with pytest.raises(InvalidRequestError) as e:
        check_tools(tools)
    assert message in str(e.value)
    assert e.value.param == "tools"
    assert isinstance(e.value, ValueError)


def test_check_tools_limits_are_inclusive():
    assert len(check_tools([tool(f"f{i}") for i in range(128)])) == 128
    assert check_tools([tool("A-z_0" + "9" * 59)])[0]["name"] == "A-z_0" + "9" * 59


# ------------------------------------------------------------------------------ check_tool_choice


def test_tool_choice_defaults_and_strings():
    functions = check_tools(TOOLS)
    assert check_tool_choice(None, functions) == "auto"
    assert check_tool_choice(None, []) == "none"
    assert check_tool_choice(None, None) == "none"
    assert check_tool_choice("none", functions) == "none"
    assert check_tool_choice("auto", functions) == "auto"
    assert check_tool_choice("auto", []) == "none"  # nothing to call
    assert check_tool_choice("required", functions) == "required"
    assert check_tool_choice("none", []) == "none"


def test_tool_choice_named():
    named = {"type": "function", "function": {"name": "get_time"}}
    assert check_tool_choice(named, check_tools(TOOLS)) == named
    assert check_tool_choice(named, TOOLS) == named  # the raw tools do too
    extra = {"type": "function", "function": {"name": "get_time", "x": 1}, "y": 2}
    assert check_tool_choice(extra, TOOLS) == named


@pytest.mark.parametrize(
    "choice, tools, message",
    [
        ("required", [], 'tool_choice "required" needs tools; send tools, or choose'),
        ("always", TOOLS, 'tool_choice must be "none", "auto", "required" or {"type": '
         '"function", "function": {"name": ...}}; got \'always\''),
        (3, TOOLS, "tool_choice must be"),
        ({"type": "tool", "function": {"name": "get_time"}}, TOOLS,
         'tool_choice.type must be "function"'),
        ({"type": "function"}, TOOLS, 'tool_choice.function must be {"name": ...}'),
        ({"type": "function", "function": {"name": ""}}, TOOLS, "tool_choice.function must"),
        ({"type": "function", "function": "get_time"}, TOOLS, "tool_choice.function must"),
        ({"type": "function", "function": {"name": "get_news"}}, TOOLS,
         'tool_choice names function "get_news", which is not among tools ("get_weather", '
         '"get_time"); send it in tools, or choose "auto"'),
        ({"type": "function", "function": {"name": "f"}}, [], "(none were sent)"),
    ],
)
def test_tool_choice_errors(choice, tools, message):
    with pytest.raises(InvalidRequestError) as e:
        check_tool_choice(choice, tools)
    assert message in str(e.value)
    assert e.value.param == "tool_choice"


# ------------------------------------------------------------------------------ forced calls


def test_forced_schema_named_is_the_parameters():
    functions = check_tools(TOOLS)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_call_schema(functions, choice, parallel=True) == WEATHER_PARAMS
    text = '{"city": "Zürich", "unit": "c"}'
    [call] = parse_forced_calls(text, functions, choice)
    assert call.name == "get_weather"
    assert call.arguments == json.dumps({"city": "Zürich", "unit": "c"}, ensure_ascii=False)
    assert "Zürich" in call.arguments
    time = {"type": "function", "function": {"name": "get_time"}}
    assert forced_call_schema(functions, time, False) == {"type": "object", "properties": {}}
    assert pairs(parse_forced_calls(" {} ", functions, time)) == [("get_time", {})]


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_schema_required(parallel):
    functions = check_tools(TOOLS)
    schema = forced_call_schema(functions, "required", parallel)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert ("maxItems" in schema) is not parallel and schema.get("maxItems", 1) == 1
    assert schema["items"]["anyOf"] == [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    sample = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    if parallel:
        sample.append({"name": "get_time", "parameters": {}})
    calls = parse_forced_calls(json.dumps(sample), functions, "required")
    assert pairs(calls) == [(s["name"], s["parameters"]) for s in sample]
    assert len({c.id for c in calls}) == len(calls)


def test_forced_schema_accepts_what_it_should():
    """The schema, read by a JSON schema validator, allows the outputs parse_forced_calls
    reads and rejects the rest (jsonschema comes with the test extra's schemathesis)."""
    jsonschema = pytest.importorskip("jsonschema")
    functions = check_tools(TOOLS)
    one = forced_call_schema(functions, "required", parallel=False)
    many = forced_call_schema(functions, "required", parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    two = good + [{"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, one)
    jsonschema.validate(two, many)
    bad = [
        (two, one),  # two calls, not parallel
        ([], many),
        ([{"name": "get_news", "parameters": {}}], many),
        ([{"name": "get_weather", "parameters": {}}], many),  # city is required
        ([{"name": "get_time"}], many),
        ([{"name": "get_time", "parameters": {}, "why": "x"}], many),
    ]
    for value, schema in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)


def test_forced_calls_cut_short():
    functions = check_tools(TOOLS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for text, choice in [
        ('{"city": "Par', named),
        ("", named),
        ('[{"name": "get_time", "parameters": {}}', "required"),
        ('[{"name": "get_time", "param', "required"),
    ]:
        with pytest.raises(ValueError, match="not complete JSON"):
            parse_forced_calls(text, functions, choice)
    for text, choice in [
        ('["Paris"]', named),
        ("[]", "required"),
        ('{"name": "get_time", "parameters": {}}', "required"),
        ('[{"name": "get_news", "parameters": {}}]', "required"),
        ('[{"name": "get_time", "parameters": 1}]', "required"),
    ]:
        with pytest.raises(ValueError):
            parse_forced_calls(text, functions, choice)
    with pytest.raises(ValueError, match="forces no call"):
        forced_call_schema(functions, "auto", True)
    with pytest.raises(ValueError, match="forces no call"):
        parse_forced_calls("[]", functions, "none")
    with pytest.raises(ValueError, match="no function 'f'"):
        forced_call_schema(functions, {"type": "function", "function": {"name": "f"}}, True)


# ------------------------------------------------------------------------------ parsers


def test_unknown_parser():
    assert TOOL_CALL_PARSERS == ("hermes", "llama3_json")
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'; choose one of "
                       "hermes, llama3_json"):
        ToolCallParser("mistral")


def hermes_block(name, arguments, key="arguments"):
    return "<tool_call>\n" + json.dumps({"name": name, key: arguments}) + "\n</tool_call>"


WEATHER = hermes_block("get_weather", {"city": "Paris"})
TIME = hermes_block("get_time", {})

HERMES_CASES = [
    # (output, content, calls)
    ("Hello, world.", "Hello, world.", []),
    ("", None, []),
    (" \n ", None, []),
    (WEATHER, None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + WEATHER + "\n" + TIME + "\n", "Let me check.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("A " + TIME + " B", "A  B", [("get_time", {})]),
    (hermes_block("f", {"x": [1, 2]}, key="parameters"), None, [("f", {"x": [1, 2]})]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", {"a": 1})]),
    ('<tool_call>{"name": "東京", "arguments": {"q": "日本語 ✓"}}</tool_call>', None,
     [("東京", {"q": "日本語 ✓"})]),
    ("x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "nope"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "nope"}</tool_call>', []),
    ('<tool_call>[{"name": "f", "arguments": {}}]</tool_call>',
     '<tool_call>[{"name": "f", "arguments": {}}]</tool_call>', []),
    ('Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}', "Sure.", [("f", {"a": 1})]),
    ('Sure. <tool_call>{"name": "f", "argu', 'Sure. <tool_call>{"name": "f", "argu', []),
    ("x < y, and <tool_ca", "x < y, and <tool_ca", []),
    ("</tool_call> stray " + TIME, "</tool_call> stray", [("get_time", {})]),
    ("<tool_call><tool_call>" + TIME[len("<tool_call>"):],
     "<tool_call><tool_call>" + TIME[len("<tool_call>"):], []),
    ("<" + TIME + ">", "<>", [("get_time", {})]),
    (TIME + "<tool_call>oops</tool_call>" + WEATHER, "<tool_call>oops</tool_call>",
     [("get_time", {}), ("get_weather", {"city": "Paris"})]),
    ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
    ("<tool_call>", "<tool_call>", []),
    ("<tool_call>\n", "<tool_call>", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_parse(text, content, calls):
    got_content, got_calls = ToolCallParser("hermes").parse(text)
    assert got_content == content
    assert pairs(got_calls) == calls


def test_hermes_keeps_unicode_in_arguments():
    [call] = ToolCallParser("hermes").parse(hermes_block("f", {"city": "München"}))[1]
    assert call.arguments == '{"city": "München"}'  # json.dumps wrote \u00fc: undone


def llama(name, parameters, key="parameters"):
    return json.dumps({"name": name, key: parameters})


LLAMA_CASES = [
    (llama("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("\n  " + llama("get_time", {}) + " \n", None, [("get_time", {})]),
    ("<|python_tag|>" + llama("get_time", {}), None, [("get_time", {})]),
    ("<|python_tag|> " + llama("a", {}) + "; " + llama("b", {"x": 1}, key="arguments"), None,
     [("a", {}), ("b", {"x": 1})]),
    (llama("a", {}) + ";" + llama("b", {}) + ";", None, [("a", {}), ("b", {})]),
    (llama("f", {"q": "日本語"}), None, [("f", {"q": "日本語"})]),
    ("The weather is fine.", "The weather is fine.", []),
    ("", None, []),
    ("  ", None, []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ('{"name": "Bob"}', '{"name": "Bob"}', []),
    (llama("f", {}) + " Hope that helps.", llama("f", {}) + " Hope that helps.", []),
    (llama("f", {}) + "; " + '{"x": 1}', llama("f", {}) + "; " + '{"x": 1}', []),
    (llama("f", {}) + ";;", llama("f", {}) + ";;", []),
    ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a":', []),
    ("{not json}", "{not json}", []),
    ("Call " + llama("f", {}), "Call " + llama("f", {}), []),
    ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")',
     []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ("<|python_tag|>  ", "<|python_tag|>", []),
    ("<|pyth", "<|pyth", []),
    ("<b>bold</b>", "<b>bold</b>", []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_parse(text, content, calls):
    got_content, got_calls = ToolCallParser("llama3_json").parse(text)
    assert got_content == content
    assert pairs(got_calls) == calls


# ------------------------------------------------------------------------------ streaming


def streamed(parser, pieces):
    stream = parser.stream()
    content, calls = [], []
    for piece in pieces:
        text, done = stream.feed(piece)
        content.append(text)
        calls += done
    text, done = stream.finish()
    calls += done
    return "".join(content + [text]), [(c.name, c.arguments) for c in calls]


def whole(parser, text):
    content, calls = parser.parse(text)
    return content or "", [(c.name, c.arguments) for c in calls]


def cuts(text, rng):
    """Every way to cut `text` in two, in three when it is short, and random cuts into many
    pieces (one character each among them)."""
    n = len(text)
    yield [text]
    yield list(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    if n <= 80:
        for i, j in itertools.combinations(range(1, n), 2):
            yield [text[:i], text[i:j], text[j:]]
    for _ in range(30):
        points = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(2, 12))))
        yield [text[a:b] for a, b in zip([0] + points, points + [n])]


SHORT_HERMES = [
    "Hi <tool_call>{\"name\":\"f\"}</tool_call> yo ",
    "a<tool_call>x</tool_call>\n<tool_call>{\"name\":\"g\",\"arguments\":{}}",
    " <<tool_call>{\"name\":\"f\"}</tool_call>< ",
    "x <tool_cal <tool_call>{\"name\":\"h\"",
]
SHORT_LLAMA = [
    '<|python_tag|>{"name":"f","parameters":{}}; ',
    ' {"name":"f","parameters":{}} ok',
    '{"name":"a","arguments":{}};{"name":"b","parameters":{"x":1}}',
    "<|python_t> no",
]


@pytest.mark.parametrize(
    "kind, texts",
    [
        ("hermes", [case[0] for case in HERMES_CASES] + SHORT_HERMES),
        ("llama3_json", [case[0] for case in LLAMA_CASES] + SHORT_LLAMA),
    ],
)
def test_stream_matches_parse_however_cut(kind, texts):
    """The content pieces joined are exactly parse's content ("" for None: the stream holds
    back the whitespace around the content that parse strips, so no .strip() is needed),
    and the calls are parse's calls, in order, for every cut tried."""
    parser = ToolCallParser(kind)
    rng = random.Random(0)
    for text in texts:
        want = whole(parser, text)
        for pieces in cuts(text, rng):
            assert streamed(parser, pieces) == want, (text, pieces)


def test_stream_gives_each_call_when_its_block_closes():
    stream = ToolCallParser("hermes").stream()
    assert stream.feed("Let me check") == ("Let me check", [])
    assert stream.feed(". <tool") == (".", [])  # the space, and what may be a tag, wait
    assert stream.feed("_call>\n{\"name\": \"get_time\", ") == ("", [])
    content, calls = stream.feed('"arguments": {}}\n</tool_call>\n')
    assert content == "" and pairs(calls) == [("get_time", {})]
    # the whitespace between goes out with the next content: a block that is not a call
    assert stream.feed("<tool_call>broken</tool_call>") == (" \n<tool_call>broken</tool_call>", [])
    assert stream.feed(" \n") == ("", [])
    assert stream.finish() == ("", [])  # the trailing whitespace parse strips


def test_llama3_stream_decides_as_soon_as_it_can():
    parser = ToolCallParser("llama3_json")
    stream = parser.stream()
    assert stream.feed(" ") == ("", [])
    assert stream.feed("The") == ("The", [])  # cannot be a call: given at once
    assert stream.feed(" answer") == (" answer", [])
    stream = parser.stream()
    assert stream.feed('{"city": ') == ("", [])  # may be a call: held
    assert stream.feed('"Paris"}') == ('{"city": "Paris"}', [])  # a whole object, not a call
    stream = parser.stream()
    assert stream.feed('{"name": "f", "parameters": {}}') == ("", [])
    assert stream.feed(" ") == ("", [])
    assert stream.feed("Done") == ('{"name": "f", "parameters": {}} Done', [])
    stream = parser.stream()
    assert stream.feed('<|python_tag|>{"name": "f", "parameters": {"a": 1}};') == ("", [])
    content, calls = stream.finish()
    assert content == "" and pairs(calls) == [("f", {"a": 1})]


def test_hermes_stream_long_block_fed_by_the_character():
    """A block of 20k characters fed one at a time stays cheap: the search for its end goes
    on from where the last piece's stopped."""
    arguments = {"text": "word " * 4000}
    text = "Here: " + hermes_block("write", arguments) + " done"
    content, calls = streamed(ToolCallParser("hermes"), list(text))
    assert content == "Here:  done"
    assert [(name, json.loads(args)) for name, args in calls] == [("write", arguments)]


# ------------------------------------------------------------------------------ detect

QWEN_TEMPLATE = (
    "{%- if tools %}You may call one or more functions...<tools>{{ tool | tojson }}</tools>"
    "For each function call, return a json object within <tool_call></tool_call> XML tags"
)
LLAMA31_TEMPLATE = (
    '{{- "Environment: ipython\\n" }}...Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}...{{- "<|eom_id|>" }}'
)


@pytest.mark.parametrize(
    "template, kind",
    [
        (QWEN_TEMPLATE, "hermes"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        ("{{ '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ("{{ '<|eom_id|>' }}", "llama3_json"),
        ("{{- 'Environment: ipython' }}", "llama3_json"),
        ('{"name": function name, "parameters": dictionary of argument name}', "llama3_json"),
        ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", None),
        ("[TOOL_CALLS]", None),
        ("", None),
        (None, None),
    ],
)
def test_detect_tool_call_parser(template, kind):
    assert detect_tool_call_parser(template) == kind
