"""The server's logprobs, token by token, equal LLM.generate's for the same prompts and
SamplingParams (tests/engine/test_logprobs.py holds those equal to transformers'): completions
`logprobs` and chat `top_logprobs`, streamed and not, for prompts batched together, so no
choice shows another's distribution or its own shifted by a token."""

import asyncio

import pytest

from nanovllm import SamplingParams
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.harness import (
    COUNTING,
    FRANCE,
    async_client,
    offline_llm,
    pause_front_end,
    post,
)

pytestmark = pytest.mark.slow

# Server and offline engine run the same float32 CPU kernels; only the batch around a row
# differs, which moved a logprob by 2e-6 at most here. A neighbouring token's or another
# request's logprob is off by far more than 1e-4.
TOL = 1e-4
MAX_TOKENS = 6
TEXTS = [COUNTING, "The capital of France is", "Once upon a time, in a small village by the"]
CHATS = [FRANCE, [{"role": "user", "content": "Name three colors."}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]


def _offline(prompts: list[list[int]], params: SamplingParams) -> list:
    """Per prompt: [(token id, {id: logprob})] of LLM.generate's one completion."""
    outs = offline_llm().generate(prompts, params, use_tqdm=False)
    return [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)) for o in outs]


def _name(token_id: int) -> str:
    return offline_llm().tokenizer.decode([token_id], skip_special_tokens=False)


def _close(got: dict[str, float], want: dict[str, float], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: {sorted(got)} vs {sorted(want)}"
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=TOL), f"{what}: {k!r}"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_match_offline(server, model, stream):
    """Three prompts in one request (batched in the engine), logprobs=3: each token's name,
    logprob, and top 3 plus the sampled token, as LLM.generate gives them; streamed, also
    when the front end falls behind and Deltas of several tokens merge."""
    prompts = [offline_llm().tokenizer.encode(t) for t in TEXTS]
    body = dict(model=model, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
                logprobs=3, ignore_eos=True, stream=stream)
    want = _offline(prompts, CompletionRequest(**body).sampling_params())
    got: dict[int, dict[str, list]] = {}
    if stream:
        async def read() -> None:
            kw = dict(body, extra_body={"ignore_eos": body.pop("ignore_eos")})
            async with async_client(server) as aclient:
                async for chunk in await aclient.completions.create(**kw):
                    for c in chunk.choices:
                        mine = got.setdefault(c.index, {"tokens": [], "token_logprobs": [],
                                                        "top_logprobs": []})
                        for key in mine:
                            mine[key] += getattr(c.logprobs, key) or []
                        sizes.append(len(c.logprobs.tokens or []) if c.logprobs else 0)
                        if len(sizes) == 1:  # the engine runs ahead: later Deltas merge
                            pause_front_end(server, 1.5)

        sizes: list[int] = []
        asyncio.run(read())
        assert max(sizes) > 1, "no chunk carried merged Deltas: the merge path did not run"
    else:
        for c in post(server, "/v1/completions", body)["choices"]:
            got[c["index"]] = c["logprobs"]
    assert sorted(got) == list(range(len(prompts)))
    for i, entries in enumerate(want):
        lp = got[i]
        assert lp["tokens"] == [_name(t) for t, _ in entries], f"choice {i}"
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == MAX_TOKENS
        for j, (token, lps) in enumerate(entries):
            what = f"choice {i} token {j}"
            assert lp["token_logprobs"][j] == pytest.approx(lps[token], abs=TOL), what
            _close(lp["top_logprobs"][j], {_name(t): v for t, v in lps.items()}, what)


def test_chat_top_logprobs_match_offline(server, model):
    """Three chats at once, each streamed and not, top_logprobs=2: each token's name and
    logprob, and its top 2 in order, as LLM.generate gives them."""
    sampling = dict(max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2)
    params = ChatCompletionRequest(messages=FRANCE, ignore_eos=True, **sampling)
    llm = offline_llm()
    want = _offline([llm.engine.render_chat(m) for m in CHATS], params.sampling_params())

    async def one(aclient, messages, stream: bool) -> list:
        kw = dict(model=model, messages=messages, stream=stream,
                  extra_body={"ignore_eos": True}, **sampling)
        if not stream:
            return (await aclient.chat.completions.create(**kw)).choices[0].logprobs.content
        entries = []
        async for chunk in await aclient.chat.completions.create(**kw):
            for c in chunk.choices:
                entries += c.logprobs.content if c.logprobs and c.logprobs.content else []
        return entries

    async def run() -> list:
        async with async_client(server) as aclient:
            calls = [one(aclient, m, s) for s in (False, True) for m in CHATS]
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    for k, content in enumerate(results):
        entries = want[k % len(CHATS)]
        assert len(content) == MAX_TOKENS, f"chat {k}"
        for j, (c, (token, lps)) in enumerate(zip(content, entries)):
            what = f"chat {k} token {j}"
            assert c.token == _name(token) and c.logprob == pytest.approx(lps[token], abs=TOL)
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:2]
            assert [t.token for t in c.top_logprobs] == [_name(t) for t, _ in top], what
            for t, (_, v) in zip(c.top_logprobs, top):
                assert t.logprob == pytest.approx(v, abs=TOL), what
