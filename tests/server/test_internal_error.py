"""A bug (an exception no handler expects) is still answered in OpenAI's shape: 500 with no
detail and `Connection: close`, and logged with what failed. In process, with a stand-in
engine client whose health check raises."""

import asyncio
import logging
from types import SimpleNamespace

import httpx

from nanovllm.entrypoints.openai.app import build_app
from nanovllm.entrypoints.openai.serving import ServerSettings


class _BrokenClient:
    info = SimpleNamespace(max_model_len=64, vocab_size=512, max_num_seqs=4,
                           reasoning_parser=None, tool_call_parser=None)

    @property
    def alive(self) -> bool:
        raise RuntimeError("a bug in the health check")


def test_a_bug_is_500_with_connection_close_and_logged(caplog):
    app = build_app(_BrokenClient(), None, ServerSettings(served_model_name="m"))

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/health")

    with caplog.at_level(logging.ERROR, logger="nanovllm.server"):
        resp = asyncio.run(get())
    assert resp.status_code == 500 and resp.headers["connection"] == "close", resp.headers
    error = resp.json()["error"]
    assert error["code"] == "internal_error" and "bug" not in error["message"], error
    assert any("a bug in the health check" in r.getMessage() for r in caplog.records)
