"""Tool calling and reasoning in the Python API (`LLM.chat`), on a random tiny model whose
chat template renders tools and thinking the way Qwen3's does (tests/support.AGENT_TEMPLATE).

A random model writes no `<think>` or `<tool_call>` of its own accord, so the parsers are
tested on forced text: a `choice` constraint makes the model write exactly the reply a test
needs (with thinking turned off in the prompt, so the constraint applies from the first
token), and the parse of that reply is what is checked."""

import json

import jsonschema
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import StructuredOutputsParams
from tests.support import build_tiny_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,  # a random model would add keys without end
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                              "maximum": 14}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "the weather in the city"}]
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-agent"), "llama", agent=True,
                            max_position_embeddings=2048)  # tools in JSON take ~500 tokens


@pytest.fixture(scope="module")
def llm(agent_model):
    return LLM(str(agent_model), device="cpu", block_size=4, num_kv_blocks=1024,
               max_num_seqs=16, reasoning_parser="qwen3")


def forced(text: str, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, **{"max_tokens": 300, **kw},
                          structured_outputs=StructuredOutputsParams(choice=[text]))


def sampled(n: int = 20) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=200, n=n)


def check_calls(calls, names) -> None:
    assert calls
    for call in calls:
        assert call.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_tool_choice_required_always_parses_and_validates(llm):
    out = llm.chat(ASK, sampled(), use_tqdm=False, tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False, chat_template_kwargs=NO_THINKING)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        assert len(c.tool_calls) == 1 and c.content is None
        check_calls(c.tool_calls, set(SCHEMAS))


def test_parallel_calls_and_a_named_function(llm):
    out = llm.chat(ASK, sampled(), use_tqdm=False, tools=TOOLS, tool_choice="required",
                   chat_template_kwargs=NO_THINKING)[0]
    for c in out.outputs:
        check_calls(c.tool_calls, set(SCHEMAS))
    named = {"type": "function", "function": {"name": "get_time"}}
    out = llm.chat(ASK, sampled(), use_tqdm=False, tools=TOOLS, tool_choice=named,
                   chat_template_kwargs=NO_THINKING)[0]
    for c in out.outputs:
        assert [call.name for call in c.tool_calls] == ["get_time"]
        check_calls(c.tool_calls, {"get_time"})


def test_auto_reads_the_templates_format(llm):
    """hermes, found in the template; the calls come out of the text, the rest is content."""
    assert llm.engine.tool_call_parser == "hermes"
    reply = ('I will look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
             '"unit": "c"}}\n</tool_call>')
    c = llm.chat(ASK, forced(reply), use_tqdm=False, tools=TOOLS,
                 chat_template_kwargs=NO_THINKING)[0].outputs[0]
    assert c.text == reply
    assert c.content == "I will look."
    assert [(t.name, json.loads(t.arguments)) for t in c.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})]
    plain = llm.chat(ASK, forced("no call here"), use_tqdm=False, tools=TOOLS,
                     tool_choice="none", chat_template_kwargs=NO_THINKING)[0].outputs[0]
    assert plain.content == "no call here" and plain.tool_calls == []


def test_tools_and_results_round_trip_through_the_template(llm):
    """The tools reach the template; an assistant's calls (arguments as OpenAI's JSON text)
    and the tool's result render as the template writes them."""
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]
    ids = llm.engine.render_chat(turns, tools=TOOLS)
    text = llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert '"name": "get_weather", "description": "the weather in a city"' in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in text
    assert "<tool_response>\n4 degrees\n</tool_response>" in text
    out = llm.chat(turns, forced("It is 4 degrees in Oslo."), use_tqdm=False, tools=TOOLS,
                   chat_template_kwargs=NO_THINKING)[0].outputs[0]
    assert out.content == "It is 4 degrees in Oslo."


def test_reasoning_is_split_from_the_answer(llm):
    reply = "<think>The user wants a colour.</think>\n\nBlue."
    c = llm.chat(ASK, forced(reply), use_tqdm=False,
                 chat_template_kwargs=NO_THINKING)[0].outputs[0]
    assert c.text == reply
    assert (c.reasoning_content, c.content) == ("The user wants a colour.", "Blue.")
    cut = llm.chat(ASK, forced(reply, max_tokens=10), use_tqdm=False,
                   chat_template_kwargs=NO_THINKING)[0].outputs[0]
    assert cut.finish_reason == "length" and cut.content is None  # still thinking


def test_a_constraint_applies_to_the_answer_after_thinking(llm):
    """Thinking on (the prompt leaves `<think>` open): the reasoning runs unconstrained and
    the schema holds from `</think>` on; thinking off: from the first token."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    off = llm.chat(ASK, SamplingParams(temperature=1.0, max_tokens=30, n=10,
                                       structured_outputs=so),
                   use_tqdm=False, chat_template_kwargs=NO_THINKING)[0]
    for c in off.outputs:
        assert json.loads(c.content) in ({"ok": True}, {"ok": False})
    engine = llm.engine
    seq_ids = set()
    on = SamplingParams(temperature=1.0, max_tokens=12, structured_outputs=so)
    request = engine.add_request(engine.render_chat(ASK), on)
    for seq in engine.requests[request].seqs:
        seq_ids.add(seq.seq_id)
        assert engine.structured.by_seq[seq.seq_id].waiting_for is not None
    while engine.has_unfinished_requests():
        engine.step()
    assert not seq_ids & set(engine.structured.by_seq)


@pytest.mark.parametrize("tools, choice, says", [
    ([{"type": "function", "function": {"name": "bad name!"}}], None,
     "tools[0].function.name"),
    ([{"type": "retrieval"}], None, 'tools[0].type must be "function"'),
    ([WEATHER, WEATHER], None, "repeats"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
])
def test_bad_tools_fail_before_anything_runs(llm, tools, choice, says):
    with pytest.raises(InvalidRequestError, match=says.replace("[", r"\[").replace("]", r"\]")):
        llm.chat(ASK, sampled(1), use_tqdm=False, tools=tools, tool_choice=choice)
    assert not llm.engine.requests


def test_auto_without_a_known_format_says_what_to_do(tiny_llama):
    plain = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64)
    assert plain.engine.tool_call_parser is None  # its template shows no tool format
    with pytest.raises(InvalidRequestError, match="--tool-call-parser"):
        plain.chat(ASK, sampled(1), use_tqdm=False, tools=TOOLS)
    out = plain.chat(ASK, sampled(3), use_tqdm=False, tools=TOOLS, tool_choice="required")
    for c in out[0].outputs:
        check_calls(c.tool_calls, set(SCHEMAS))


def test_a_reasoning_parser_needs_its_end_token(tiny_llama):
    from nanovllm.core.errors import ConfigError

    llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64,
              reasoning_parser="qwen3")
    with pytest.raises(ConfigError, match="no </think> token"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="a+")), use_tqdm=False)
