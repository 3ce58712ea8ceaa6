"""Sampling through the server: seeds reproducible alone and batched, n > 1, logprobs, and
exact usage counts."""

import asyncio

import pytest

from tests.server.harness import (
    COUNTING,
    FRANCE,
    GREEDY,
    async_client,
    read_completion_stream,
    tokenize,
)

pytestmark = pytest.mark.slow


# ---- seeds, n > 1 -----------------------------------------------------------------------------


def test_seed_reproducible_sync_stream_and_under_load(server, client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=1234)
    first = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == first
    texts, _, _, _ = read_completion_stream(client.completions.create(stream=True, **kw))
    assert texts == {0: first}

    async def under_load() -> str:
        async with async_client(server) as aclient:
            noise = [
                aclient.completions.create(
                    model=model, prompt=f"Story {i}:", max_tokens=16, temperature=1.0
                )
                for i in range(4)
            ]
            results = await asyncio.gather(aclient.completions.create(**kw), *noise)
            return results[0].choices[0].text

    assert asyncio.run(under_load()) == first, "seeded output changed when batched with others"


def test_n_completions(server, client, model):
    kw = dict(
        model=model,
        prompt="Once upon a time",
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 24, full.usage
    texts = {c.index: c.text for c in full.choices}
    assert len(set(texts.values())) > 1, f"n=3 seeded samples are all identical: {texts}"
    streamed, reasons, _, _ = read_completion_stream(client.completions.create(stream=True, **kw))
    assert streamed == texts and reasons == {0: "length", 1: "length", 2: "length"}


def test_n_chat_greedy(server, client, model):
    one = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=24, **GREEDY)
    two = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=24, n=2, **GREEDY)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert {c.message.content for c in two.choices} == {one.choices[0].message.content}
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens


# ---- logprobs and usage -----------------------------------------------------------------------


def test_completion_logprobs(server, client, model):
    resp = client.completions.create(
        model=model, prompt=COUNTING, max_tokens=6, logprobs=3, **GREEDY
    )
    lp = resp.choices[0].logprobs
    n = resp.usage.completion_tokens
    assert n == 6 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == resp.choices[0].text
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4, top
        assert token in top and chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy


def test_chat_logprobs_stream_and_not(server, client, model):
    kw = dict(model=model, messages=FRANCE, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    resp = client.chat.completions.create(**kw)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-4) and c.logprob <= 0
    entries = []
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    ):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    assert [e.token for e in entries] == [c.token for c in content]


def test_usage_exact(server, client, model, tokenizer):
    prompt = "The capital of France is"
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert resp.usage.prompt_tokens == len(tokenize(server, model, prompt))
    assert resp.usage.completion_tokens == 7 and resp.choices[0].finish_reason == "length"
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7

    # a natural stop: EOS counts as generated, one logprob entry per generated token
    chat = client.chat.completions.create(
        model=model, messages=FRANCE, max_tokens=24, logprobs=True, **GREEDY
    )
    rendered = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens == len(chat.choices[0].logprobs.content)

    # the streamed usage chunk: last before [DONE], no choices, same counts
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=FRANCE,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
    assert all(c.usage is None for c in chunks[:-1]), "usage before the final chunk"
    assert chunks[-1].usage.model_dump() == chat.usage.model_dump()
