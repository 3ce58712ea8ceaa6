"""Fixtures of the server tests: one `nanovllm serve` with the default model on CPU, started
once for the whole session and shared by every file that asks for `server`."""

import httpx
import openai
import pytest

from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.model.loader.source import open_model
from tests.server.harness import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MAX_REQUEST_BYTES,
    start_server,
    stop_server,
)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    flags = (
        f"--max-model-len {MAX_MODEL_LEN} --max-num-seqs {MAX_NUM_SEQS} --max-num-waiting 128 "
        f"--max-request-bytes {MAX_REQUEST_BYTES} --kv-cache-gib 0.5 --weight-format dense"
    )
    srv = start_server(tmp_path_factory, "server", *flags.split())
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def model(server) -> str:
    """The served model name, as /v1/models lists it."""
    resp = httpx.get(server.url + "/v1/models", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()["data"][0]["id"]


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="dummy", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, loaded as the server loads it."""
    return load_tokenizer(open_model(None))
