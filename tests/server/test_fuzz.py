"""The HTTP API fuzzed, on a server of its own (the tiny model, a 64-token context so any
max_tokens stays cheap, an API key): schemathesis against the server's own /openapi.json
(no 5xx; every status, content type, header, body and stream event as the schema declares;
schema-invalid bodies refused; the key enforced), then hypothesis posting random bytes and
random JSON to every route. Neither may cause a 5xx or an error in the server's log.

More examples locally: NANOVLLM_FUZZ_EXAMPLES=1000 python -m pytest tests/server/test_fuzz.py
"""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.harness import error_of, start_server, stop_server

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("NANOVLLM_FUZZ_EXAMPLES", "100"))  # per operation
SEED = "20261130"  # the same cases in every CI run; change it to explore
ROUTES = [
    ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"), ("POST", "/detokenize"),
]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, tiny_llama):
    flags = (
        f"--model {tiny_llama} --api-key {KEY} --max-model-len 64 --max-num-seqs 4 "
        "--max-num-waiting 8 --kv-cache-gib 0.05"
    )
    srv = start_server(tmp_path_factory, "fuzz", *flags.split())
    yield srv
    stop_server(srv)  # and its log: no error, no traceback, after all of it


def test_openapi_lists_every_route_with_its_body(fuzz_server):
    schema = httpx.get(fuzz_server.url + "/openapi.json", timeout=10).json()
    routes = {(m.upper(), path) for path, ops in schema["paths"].items() for m in ops}
    assert routes == set(ROUTES)
    components = schema["components"]["schemas"]
    for method, path in ROUTES:
        op = schema["paths"][path][method.lower()]
        assert "200" in op["responses"], (path, op["responses"])
        if method == "POST":
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in components, ref
            assert {"400", "401", "413", "415"} <= set(op["responses"]), (path, op["responses"])


def test_the_key_guards_the_model_not_the_probes(fuzz_server):
    url = fuzz_server.url
    for method, path in ROUTES:
        if path in ("/health", "/metrics"):  # /metrics: open without --protect-metrics
            continue
        resp = httpx.request(method, url + path, json={"prompt": "Hi"}, timeout=10)
        assert error_of(resp, 401, fuzz_server)["code"] == "invalid_api_key", path
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(url + path, timeout=10).status_code == 200, path


def test_schemathesis_finds_nothing(fuzz_server, tmp_path):
    since = fuzz_server.log_size()
    run = [
        sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()",
        "run", fuzz_server.url + "/openapi.json", "--header", f"Authorization: Bearer {KEY}",
        # positive_data_acceptance wants a 2xx for every schema-valid body, but a schema
        # cannot say that the prompt must fit the context or that ids must be in the vocabulary
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", str(EXAMPLES), "--seed", SEED, "--workers", "1",
        "--request-timeout", "60", "--generation-database", "none", "--no-color",
    ]
    t0 = time.monotonic()
    done = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-12000:] + "\nserver log:\n" + fuzz_server.log_tail(30)
    summary = [ln for ln in report.splitlines() if "generated" in ln or "No issues" in ln]
    print(f"schemathesis in {time.monotonic() - t0:.1f} s: {' '.join(summary)}")
    assert fuzz_server.log_problems(since) == []


# ---- random bodies ----------------------------------------------------------------------------

FIELDS = sorted({*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields,
                 "role", "content", "type", "text", "tokens", "include_usage"})
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
KEYS = st.sampled_from(FIELDS) | st.text(max_size=8)
# NaN and infinity go out as the NaN / Infinity literals, which are not JSON
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=6),
    max_leaves=16,
)
BODIES = st.one_of(
    st.binary(max_size=300),
    JSON_VALUES.map(json.dumps),
    st.dictionaries(KEYS, JSON_VALUES, max_size=8).map(json.dumps),
)
CONTENT_TYPES = st.sampled_from([None, "application/json", "text/plain",
                                 "application/x-www-form-urlencoded"])


def test_random_bodies_never_get_a_5xx(fuzz_server):
    since = fuzz_server.log_size()
    seen: dict[int, int] = {}
    with httpx.Client(base_url=fuzz_server.url, headers=AUTH, timeout=60) as http:

        @settings(max_examples=max(100, EXAMPLES * 2), deadline=None, database=None)
        @given(route=st.sampled_from(ROUTES), method=st.sampled_from(["GET", "POST"]),
               body=BODIES, content_type=CONTENT_TYPES)
        def post(route, method, body, content_type):
            headers = {"content-type": content_type} if content_type else {}
            resp = http.request(method, route[1], content=body, headers=headers)
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, f"{method} {route[1]} {body!r}: {resp.text[:300]}"
            if resp.status_code >= 400:
                error_of(resp, resp.status_code, fuzz_server)

        post()
    print(f"random bodies: statuses {dict(sorted(seen.items()))}")
    assert fuzz_server.log_problems(since) == []
