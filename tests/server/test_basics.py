"""The server's plain paths end to end, with the official `openai` client and raw HTTP:
health, models, tokenize, completions and chat streamed or not, SSE framing, prompt forms,
every request field, stop strings. Generations are kept short: CPU is slow."""

import json

import httpx
import pytest

from nanovllm.model.loader.source import default_model_path
from tests.server.harness import (
    COUNTING,
    FRANCE,
    GREEDY,
    read_chat_stream,
    read_completion_stream,
    tokenize,
)

pytestmark = pytest.mark.slow


# ---- basic endpoints --------------------------------------------------------------------------


def test_health_and_models(server, client, model):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [model], models
    assert model in default_model_path().stem, "the served name comes from the model file"
    raw = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model", raw


def test_tokenize_detokenize_round_trip(server, model, tokenizer):
    text = "Hello world! héllo wörld, 東京 😀"
    ids = tokenize(server, model, text)
    assert ids == tokenizer.encode(text), "server tokenization differs from the model's tokenizer"
    resp = httpx.post(server.url + "/detokenize", json={"model": model, "tokens": ids}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["prompt"] == text


# ---- completions and chat ---------------------------------------------------------------------


def test_completion_greedy_stream_equals_non_stream(server, client, model):
    kw = dict(model=model, prompt=COUNTING, max_tokens=12, **GREEDY)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and len(full.choices) == 1
    choice = full.choices[0]
    assert choice.text.startswith(" 5, 6, 7"), choice.text
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 12
    texts, reasons, usage, chunks = read_completion_stream(
        client.completions.create(stream=True, **kw)
    )
    assert texts == {0: choice.text} and reasons == {0: "length"}
    assert usage is None, "usage chunk sent without stream_options.include_usage"
    assert chunks > 2, "the text arrived in one chunk: not streamed"


def test_chat_greedy_stream_equals_non_stream(server, client, model):
    full = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=24, **GREEDY)
    assert full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content, msg
    assert full.choices[0].finish_reason == "stop"  # the model ends with EOS
    assert "<|im_end|>" not in msg.content
    stream = client.chat.completions.create(
        model=model, messages=FRANCE, max_tokens=24, stream=True, **GREEDY
    )
    texts, reasons, _, pieces = read_chat_stream(stream)
    assert texts == {0: msg.content} and reasons == {0: "stop"}
    assert sum(bool(p) for p in pieces) > 2, f"not streamed: {pieces}"


def test_raw_sse_format(server, model):
    body = {"model": model, "prompt": COUNTING, "max_tokens": 5, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1, lines
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0] is chunks[-1], chunks
    assert len({c["id"] for c in chunks}) == 1, "chunks of one request carry different ids"


def test_prompt_forms(server, client, model):
    """A string, a list of strings, token ids and a list of token-id lists."""
    kw = dict(model=model, max_tokens=6, **GREEDY)
    a = client.completions.create(prompt=COUNTING, **kw).choices[0].text
    b = client.completions.create(prompt="The capital of France is", **kw).choices[0].text
    both = client.completions.create(prompt=[COUNTING, "The capital of France is"], **kw)
    assert {c.index: c.text for c in both.choices} == {0: a, 1: b}
    ids = tokenize(server, model, COUNTING)
    assert client.completions.create(prompt=ids, **kw).choices[0].text == a
    lists = client.completions.create(prompt=[ids, ids], **kw)
    assert [c.text for c in sorted(lists.choices, key=lambda c: c.index)] == [a, a]


def test_all_request_fields_accepted(server, client, model):
    resp = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=3,
        user="tester",
        stop=["\n\n"],
        extra_body=dict(
            top_k=20,
            min_p=0.05,
            repetition_penalty=1.1,
            ignore_eos=True,
            stop_token_ids=[2],
            priority=1,
            timeout=60,
        ),
    )
    assert resp.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(
        model=model, messages=FRANCE, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


# ---- stop strings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stop, cut",
    [
        (["Paris"], "Paris"),  # one token
        ([" of France"], " of France"),  # spans tokens: " of" must be withheld, then dropped
        ([" of Germany", "Paris"], "Paris"),  # " of" withheld, then released
    ],
)
def test_chat_stop_strings(server, client, model, stop, cut):
    full = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=24, **GREEDY)
    full_text = full.choices[0].message.content
    want = full_text[: full_text.index(cut)]
    kw = dict(model=model, messages=FRANCE, max_tokens=24, stop=stop, **GREEDY)
    got = client.chat.completions.create(**kw).choices[0]
    assert got.message.content == want and got.finish_reason == "stop"
    texts, reasons, _, pieces = read_chat_stream(client.chat.completions.create(stream=True, **kw))
    assert texts == {0: want}, f"streamed pieces {pieces} != {want!r}"
    assert reasons == {0: "stop"}
    assert not any(cut in p for p in pieces)


def test_completion_stop_string_streamed(server, client, model):
    kw = dict(model=model, prompt=COUNTING, max_tokens=16, stop=[" 8,"], **GREEDY)
    got = client.completions.create(**kw).choices[0]
    assert got.text == " 5, 6, 7," and got.finish_reason == "stop", got
    texts, reasons, _, _ = read_completion_stream(client.completions.create(stream=True, **kw))
    assert texts == {0: got.text} and reasons == {0: "stop"}
