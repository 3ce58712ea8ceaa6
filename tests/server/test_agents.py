"""Structured output, tool calling and reasoning through the official `openai` client: on the
default model (pydantic parse) and on a random tiny model whose template renders tools and
thinking as Qwen3's does (tests/support.AGENT_TEMPLATE), served with --reasoning-parser
qwen3. A random model writes no tags of its own, so the reasoning and auto tool-call parsers
are tested on forced text: a `choice` constraint (vLLM's structured_outputs field) with
thinking turned off in the prompt, so the constraint holds from the first token."""

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.harness import async_client, start_server, stop_server
from tests.support import build_tiny_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                              "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "the weather in the city"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("agent-model"), "llama", agent=True,
                            max_position_embeddings=2048)
    srv = start_server(tmp_path_factory, "agent-server", "--model", str(path),
                       "--reasoning-parser", "qwen3", "--max-num-seqs", "16",
                       "--num-kv-blocks", "2048", "--block-size", "4")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def aclient(agent) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent.url + "/v1", api_key="x", max_retries=0, timeout=120)


def forced(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}, **NO_THINKING}


def test_pydantic_parse_on_the_default_model(client, model):
    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    resp = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, max_tokens=80, temperature=0.7)
    person = resp.choices[0].message.parsed
    assert isinstance(person, Person) and resp.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Reply in JSON."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0.7, seed=3,
        extra_body={"structured_outputs": None})
    choice = obj.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


def test_fifty_of_fifty_conform_at_temperature_1(aclient):
    kinds = [
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"regex": r"[A-Z][a-z]{1,4}-[0-9]{2,3}"}},
         lambda t: re.fullmatch(r"[A-Z][a-z]{1,4}-[0-9]{2,3}", t)),
        ({"structured_outputs": {"choice": ["red", "green", "dark blue"]}},
         lambda t: t in ("red", "green", "dark blue")),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": SCHEMA, "strict": True}}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ]
    m = aclient.models.list().data[0].id
    for extra, ok in kinds:
        texts = []
        for _ in range(5):  # 5 requests of n=10: 50 completions
            # thinking off: with --reasoning-parser a constraint holds after </think>
            resp = aclient.chat.completions.create(model=m, messages=ASK, n=10,
                                                   max_tokens=150, temperature=1.0,
                                                   extra_body={**extra, **NO_THINKING})
            texts += [c.message.content for c in resp.choices if c.finish_reason == "stop"]
        assert len(texts) == 50, texts
        assert all(ok(t) for t in texts), texts


def model_name(srv) -> str:
    return httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]


def test_tool_round_trip_required_and_named(agent, aclient):
    m = model_name(agent)
    resp = aclient.chat.completions.create(model=m, messages=ASK, tools=TOOLS,
                                           tool_choice="required", temperature=1.0,
                                           max_tokens=200, n=5, extra_body=NO_THINKING)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                SCHEMAS[call.function.name])
    named = aclient.chat.completions.create(
        model=m, messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=NO_THINKING)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    turns = ASK + [named.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "4 degrees"}]
    after = aclient.chat.completions.create(model=m, messages=turns, tools=TOOLS,
                                            max_tokens=20, extra_body=forced("It is 4."))
    assert after.choices[0].message.content == "It is 4."
    assert after.choices[0].message.tool_calls == []


def _streamed(aclient, **kw) -> tuple[str, str, list, str]:
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in aclient.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        extra = d.model_extra or {}
        reasoning += extra.get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_streamed_tool_calls_reassemble_to_the_whole(agent, aclient):
    m = model_name(agent)
    kw = dict(model=m, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
              max_tokens=200, seed=11, extra_body=NO_THINKING)
    whole = aclient.chat.completions.create(**kw).choices[0].message
    _, content, calls, finish = _streamed(aclient, **kw)
    assert calls == [(c.function.name, json.loads(c.function.arguments))
                     for c in whole.tool_calls]
    assert content == "" and finish == "tool_calls"
    reply = ('Checking.<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n'
             '</tool_call>')
    auto = dict(model=m, messages=ASK, tools=TOOLS, max_tokens=300, extra_body=forced(reply))
    msg = aclient.chat.completions.create(**auto).choices[0].message
    assert msg.content == "Checking." and msg.tool_calls[0].function.name == "get_time"
    _, content, calls, finish = _streamed(aclient, **auto)
    assert (content, calls, finish) == ("Checking.", [("get_time", {"zone": 2})], "tool_calls")


def test_reasoning_split_streamed_and_not(agent, aclient):
    m = model_name(agent)
    reply = "<think>A colour is asked for.</think>\n\nBlue."
    kw = dict(model=m, messages=ASK, max_tokens=200, extra_body=forced(reply))
    msg = aclient.chat.completions.create(**kw).choices[0].message
    extra = msg.model_extra
    assert (extra["reasoning_content"], extra["reasoning"]) == ("A colour is asked for.",) * 2
    assert msg.content == "Blue."
    reasoning, content, _, finish = _streamed(aclient, **kw)
    assert (reasoning, content, finish) == ("A colour is asked for.", "Blue.", "stop")


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "([a-z]+"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {
        "a": {"$ref": "#/missing"}}}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "(x{1000}){1000}"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(a|"}}}},
     "response_format.json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]},
     "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_hostile_requests_are_400s_and_disturb_nothing(agent, extra, param):
    async def run():
        client = async_client(agent)
        m = model_name(agent)
        # a request in flight while the bad ones arrive: it must finish untouched
        good = asyncio.ensure_future(client.chat.completions.create(
            model=m, messages=ASK, max_tokens=40, temperature=1.0,
            extra_body={"structured_outputs": {"regex": "(ab){3,9}"}, **NO_THINKING}))
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=m, messages=ASK, max_tokens=20,
                                                 extra_body=extra)
        body = e.value.body
        assert body["param"] == param or body["param"].startswith(param), body
        assert "Traceback" not in body["message"] and "PanicException" not in body["message"]
        out = await good
        assert re.fullmatch("(ab){3,9}", out.choices[0].message.content)

    asyncio.run(run())
    metrics = httpx.get(agent.url + "/metrics").text
    running = re.search(r"^nanovllm:num_requests_running\S* (\S+)$", metrics, re.M)
    assert running is None or float(running.group(1)) == 0.0
