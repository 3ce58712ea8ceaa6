"""Request fields beyond OpenAI's core reach the engine and act. Unit level, no server: each
field set on a request lands in its SamplingParams (priority and timeout in the AddRequest),
so a dropped field fails. Over HTTP: each changes the answer as the engine says it should.
(That priority orders waiting requests and preempts, over HTTP: test_admission.py.)"""

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from nanovllm.core.sampling_params import SamplingParams
from nanovllm.entrypoints.openai.generation import Generation
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.harness import COUNTING, FRANCE, offline_llm, post, tokenize

# ---- every field reaches SamplingParams (unit) ----------------------------------------------

# field -> a value other than SamplingParams' default, and what the field becomes there
FIELDS = {
    "n": 2,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 5,
    "min_p": 0.2,
    "seed": 3,
    "stop": ["xyz"],
    "stop_token_ids": [7, 9],
    "presence_penalty": 0.5,
    "frequency_penalty": 0.4,
    "repetition_penalty": 1.3,
    "ignore_eos": True,
    "min_tokens": 3,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
}
REQUESTS = {
    "completions": (CompletionRequest, {"prompt": "Hi"}),
    "chat": (ChatCompletionRequest, {"messages": FRANCE}),
}


@pytest.mark.parametrize("kind", sorted(REQUESTS))
@pytest.mark.parametrize("field", sorted(FIELDS))
def test_field_reaches_sampling_params(kind, field):
    model, base = REQUESTS[kind]
    value = FIELDS[field]
    assert getattr(SamplingParams(), field) != value, "pick a value other than the default"
    params = model(**base, **{field: value}).sampling_params()
    assert getattr(params, field) == value, f"{kind}: {field} did not reach SamplingParams"


def test_every_sampling_field_of_the_request_is_covered():
    """A sampling field added to the request models is added to FIELDS too."""
    request_fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    sampling = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    # max_tokens, logprobs and structured_outputs have their own shapes (tests below)
    own = {"max_tokens", "logprobs", "structured_outputs"}
    assert (request_fields & sampling) - own == set(FIELDS)


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_constraints_reach_sampling_params(kind):
    model, base = REQUESTS[kind]
    schema = {"type": "object"}
    so = model(**base, structured_outputs={"json": schema}).sampling_params().structured_outputs
    assert (so.json, so.param) == (schema, "structured_outputs")
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    so = model(**base, response_format=rf).sampling_params().structured_outputs
    assert (so.json, so.field_name()) == (schema, "response_format.json_schema")
    so = model(**base, response_format={"type": "json_object"}).sampling_params()
    assert so.structured_outputs.json_object
    assert model(**base, response_format={"type": "text"}).sampling_params().structured_outputs \
        is None


def test_max_tokens_and_logprobs_reach_sampling_params():
    done = CompletionRequest(prompt="Hi", max_tokens=7, logprobs=3).sampling_params()
    assert (done.max_tokens, done.logprobs) == (7, 3)
    chat = ChatCompletionRequest(messages=FRANCE, max_completion_tokens=9, logprobs=True,
                                 top_logprobs=2).sampling_params()
    assert (chat.max_tokens, chat.logprobs) == (9, 2)
    assert ChatCompletionRequest(messages=FRANCE, max_tokens=5).sampling_params().max_tokens == 5


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_priority_and_timeout_reach_the_engine_request(kind):
    """What is not a sampling parameter rides in the AddRequest the engine gets."""
    sent = []

    class Client:
        async def add(self, add, queue):
            sent.append(add)

    model, base = REQUESTS[kind]
    req = model(**base, priority=-3, timeout=2.5)
    server = SimpleNamespace(client=Client(), open=set())
    asyncio.run(Generation(server, "test", req, req.sampling_params(), [[1, 2, 3]]).start())
    assert [(a.priority, a.timeout) for a in sent] == [(-3, 2.5)]


# ---- each field acts, over HTTP -------------------------------------------------------------


def _complete(server, model, **body) -> dict:
    """The one choice of a completion of COUNTING (greedy: " 5, 6, 7, 8, ...")."""
    body = {"model": model, "prompt": COUNTING, "max_tokens": 12, "temperature": 0, **body}
    return post(server, "/v1/completions", body)["choices"][0]


def _chat(server, model, **body) -> dict:
    body = {"model": model, "messages": FRANCE, "max_tokens": 32, "temperature": 0, **body}
    return post(server, "/v1/chat/completions", body)


@pytest.fixture(scope="module")
def greedy(server, model) -> str:
    return _complete(server, model)["text"]


@pytest.fixture(scope="module")
def natural(server, model) -> dict:
    """The greedy chat reply, which ends with EOS."""
    reply = _chat(server, model)
    assert reply["choices"][0]["finish_reason"] == "stop"
    return reply


@pytest.mark.slow
def test_top_k_and_min_p_act(server, model, greedy):
    """Sampled at temperature 1, top_k=1 (or min_p=1: only tokens as likely as the best)
    keeps the argmax alone: greedy's text. The same seed without the filter is not greedy."""
    sampled = dict(temperature=1.0, seed=1)
    assert _complete(server, model, **sampled)["text"] != greedy, "pick another seed"
    assert _complete(server, model, **sampled, top_k=1)["text"] == greedy
    assert _complete(server, model, **sampled, min_p=1.0)["text"] == greedy


@pytest.mark.slow
def test_stop_token_ids_and_min_tokens_act(server, model, natural):
    """A stop token id ends the completion on that token (kept in the text), finish reason
    stop, stop_reason the id; min_tokens holds stop ids and EOS back until that many."""
    comma = tokenize(server, model, ",")
    assert len(comma) == 1
    stopped = _complete(server, model, stop_token_ids=comma)
    assert (stopped["text"], stopped["finish_reason"], stopped["stop_reason"]) == (
        " 5,", "stop", comma[0])
    held = _complete(server, model, stop_token_ids=comma, min_tokens=4, max_tokens=6)
    assert "," not in held["text"][:4] and held["finish_reason"] == "length"

    n = natural["usage"]["completion_tokens"]
    longer = _chat(server, model, min_tokens=n + 2, max_tokens=n + 2)
    assert longer["usage"]["completion_tokens"] == n + 2  # EOS held back, then the limit
    text = natural["choices"][0]["message"]["content"]
    assert longer["choices"][0]["message"]["content"].startswith(text)


@pytest.mark.slow
def test_include_stop_str_in_output_acts(server, model):
    cut = _complete(server, model, stop=[" 7"])
    assert (cut["text"], cut["finish_reason"], cut["stop_reason"]) == (" 5, 6,", "stop", " 7")
    kept = _complete(server, model, stop=[" 7"], include_stop_str_in_output=True)
    assert (kept["text"], kept["finish_reason"]) == (" 5, 6, 7", "stop")


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["engine decodes", "front end decodes"])
def test_skip_special_tokens_acts(server, model, client, natural, stream):
    """The EOS that ends a chat reply (<|im_end|>) shows in its text only with
    skip_special_tokens=false, whichever process decodes (a stream without stop strings is
    decoded by the front end)."""
    text = natural["choices"][0]["message"]["content"]
    assert "<|im_end|>" not in text
    kw = dict(model=model, messages=FRANCE, max_tokens=32, temperature=0,
              extra_body={"skip_special_tokens": False})
    if stream:
        chunks = client.chat.completions.create(stream=True, **kw)
        shown = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        shown = client.chat.completions.create(**kw).choices[0].message.content
    assert shown == text + "<|im_end|>"


@pytest.mark.slow
def test_repetition_penalty_over_http_equals_offline(server, model, greedy):
    """One greedy request with a repetition penalty: the server's tokens are LLM.generate's
    with the very SamplingParams the request model builds, and not plain greedy's."""
    body = dict(model=model, prompt=COUNTING, max_tokens=12, temperature=0,
                repetition_penalty=1.3, logprobs=0)
    served = post(server, "/v1/completions", body)["choices"][0]
    assert served["text"] != greedy, "the penalty changed nothing"
    params = CompletionRequest(**body).sampling_params()
    llm = offline_llm()
    offline = llm.generate([COUNTING], params, use_tqdm=False)[0].outputs[0]
    assert served["text"] == offline.text
    assert served["logprobs"]["tokens"] == [llm.tokenizer.decode([t], skip_special_tokens=False)
                                           for t in offline.token_ids]
