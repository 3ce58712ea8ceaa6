"""The front end's side of the engine pipe (EngineClient), on both event loops uvicorn picks
(asyncio, and uvloop when it is installed): messages larger than the pipe's buffer, a burst
of requests while the engine steps, and the engine dying under a waiting request.

uvloop makes any fd it watches non-blocking; a blocking `Connection` on such an fd fails
with EAGAIN once the pipe is full, so a big enough burst used to stop every request."""

import asyncio
import importlib.util

import pytest

from nanovllm import SamplingParams
from nanovllm.core.config import EngineConfig
from nanovllm.engine.messages import AddRequest, Delta, EngineProcessConfig, RejectReason
from nanovllm.entrypoints.openai.engine_client import (
    EngineClient,
    EngineDeadError,
    RequestRejected,
)
from nanovllm.entrypoints.openai.errors import api_error

ENGINE = dict(device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=64)
LOOPS = [
    "asyncio",
    pytest.param(
        "uvloop",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
        ),
    ),
]


def run(loop: str, main):
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


@pytest.fixture
def client(tiny_llama):
    c = EngineClient.start(EngineProcessConfig(str(tiny_llama), EngineConfig(**ENGINE), None))
    yield c
    c.shutdown()


async def stream(client: EngineClient, rid: str, ids: list[int], params) -> list[Delta]:
    out: asyncio.Queue = asyncio.Queue()
    await asyncio.wait_for(client.add(AddRequest(rid, ids, params, stream=True), out), 60)
    deltas = []
    while not deltas or deltas[-1].finish_reason is None:
        d = await asyncio.wait_for(out.get(), 60)
        if isinstance(d, Exception):
            raise d
        deltas.append(d)
    client.release(rid, abort=False)
    return deltas


@pytest.mark.parametrize("loop", LOOPS)
def test_oversized_messages_and_bursts_pass_the_pipe(client, loop):
    vocab = client.info.vocab_size
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        client.attach()
        # ~600 KB pickled: larger than a socket pair's buffer, so the write must wait for
        # the engine to read; the engine then refuses it (longer than the context)
        huge = [i % (vocab - 1) + 1 for i in range(200_000)]
        with pytest.raises(RequestRejected) as e:
            await asyncio.wait_for(
                client.add(AddRequest("huge", huge, params), asyncio.Queue()), 60
            )
        rejection = e.value.rejection
        assert rejection.reason is RejectReason.INVALID and "max_model_len" in rejection.message
        assert rejection.code == "context_length_exceeded" and rejection.param == "prompt"
        err = api_error(e.value)  # what the HTTP client gets: OpenAI's body, status 400
        assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
        # a burst larger than max_num_seqs, with long prompts, while the engine steps
        prompts = [[(7 * j + i) % (vocab - 1) + 1 for i in range(120)] for j in range(40)]
        results = await asyncio.gather(
            *(stream(client, f"r{j}", p, params) for j, p in enumerate(prompts))
        )
        for deltas in results:
            assert sum(len(d.token_ids) for d in deltas) == 6
            assert deltas[-1].finish_reason == "length"
        s = await client.stats()
        assert s.num_free_kv_blocks == s.num_kv_blocks
        assert s.num_requests_running == s.num_requests_waiting == 0

    run(loop, main)
    assert client.alive


@pytest.mark.parametrize("loop", LOOPS)
def test_engine_death_reaches_waiting_requests(client, loop):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        client.attach()
        out: asyncio.Queue = asyncio.Queue()
        await client.add(AddRequest("long", [1, 2, 3], params, stream=True), out)
        await asyncio.wait_for(out.get(), 60)  # it is generating
        client.proc.kill()
        while not isinstance(item := await asyncio.wait_for(out.get(), 30), Exception):
            pass
        assert isinstance(item, EngineDeadError) and "killed by signal 9" in str(item)
        with pytest.raises(EngineDeadError):
            await client.add(AddRequest("late", [1, 2, 3], params), asyncio.Queue())

    run(loop, main)
    assert not client.alive
