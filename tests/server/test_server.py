"""The OpenAI-compatible server end to end: the real `nanovllm serve` in a subprocess with the
default model on CPU, driven by the official `openai` client (sync and async) and raw HTTP.

Two servers are started per module: `server` (the main one) and `strict_server` (an API key
and a tiny waiting queue, for 401 and 429). Generations are kept short: CPU is slow.
"""

import asyncio
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanovllm.model.loader.source import default_model_path

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 16
MAX_REQUEST_BYTES = 200_000
API_KEY = "test-secret-key"
STRICT_SEQS, STRICT_WAITING = 2, 2
START_TIMEOUT_S = 240.0  # a loaded 2-core CI box needs a while to import torch twice

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
COUNTING = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8, 9, 10, ..."
GREEDY = dict(temperature=0.0)


# ---- the server process ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the test process dies, so none is left behind."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) for every process, read from /proc."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(stat.parent.name)] = (int(fields[1]), fields[0])
    return table


def _alive(pid: int) -> bool:
    state = _process_table().get(pid)
    return state is not None and state[1] not in ("Z", "X")


class ServerProcess:
    """`python -m nanovllm serve` on a free loopback port, output to a log file."""

    def __init__(self, log_path: Path, *args: str, env: dict | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        flags = f"--host 127.0.0.1 --port {self.port} --device cpu"
        self.args = [sys.executable, "-m", "nanovllm", "serve", *flags.split(), *args]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        paths = [str(REPO), os.environ.get("PYTHONPATH")]  # this checkout, installed or not
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        full_env.update(env or {})
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            self.args,
            cwd=REPO,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self.known_children: set[int] = set()

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"server exited with status {self.proc.returncode} before /health "
                    f"answered 200:\n{' '.join(self.args)}\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.known_children |= set(self.descendants())
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"/health not 200 after {timeout:.0f} s:\n{self.log_tail()}")

    def descendants(self) -> list[int]:
        table = _process_table()
        found, frontier = [], [self.proc.pid]
        while frontier:
            parent = frontier.pop()
            kids = [p for p, (pp, _) in table.items() if pp == parent]
            found += kids
            frontier += kids
        return found

    def engine_pid(self) -> int:
        """The engine process: the child started with multiprocessing's spawn."""
        for pid in self.descendants():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                return pid
        raise AssertionError(f"no spawned engine process under server pid {self.proc.pid}")

    def stop(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM, as a supervisor would send; returns what went wrong (nothing, ideally).
        Whatever is left afterwards is killed by pid, so no process outlives the tests."""
        problems = []
        if self.proc.poll() is None:
            self.known_children |= set(self.descendants())
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                problems.append(f"server still running {timeout:.0f} s after SIGTERM")
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(_alive(p) for p in self.known_children):
            time.sleep(0.2)
        for pid in sorted(p for p in self.known_children if _alive(p)):
            problems.append(f"server child process {pid} outlived the server")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        return problems


def _start(tmp_path_factory, name: str, *args: str, env: dict | None = None):
    srv = ServerProcess(tmp_path_factory.mktemp(name) / "server.log", *args, env=env)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop(timeout=5.0)
        raise
    return srv


def _finish(srv: ServerProcess) -> None:
    problems = srv.stop()
    assert not problems, "unclean shutdown: " + "; ".join(problems) + "\n" + srv.log_tail()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = (
        f"--max-model-len {MAX_MODEL_LEN} --max-num-seqs {MAX_NUM_SEQS} --max-num-waiting 128 "
        f"--max-request-bytes {MAX_REQUEST_BYTES} --kv-cache-gib 0.5"
    )
    srv = _start(tmp_path_factory, "server", *flags.split())
    yield srv
    _finish(srv)


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    flags = (
        f"--api-key {API_KEY} --max-model-len 256 --max-num-seqs {STRICT_SEQS} "
        f"--max-num-waiting {STRICT_WAITING} --kv-cache-gib 0.1"
    )
    srv = _start(tmp_path_factory, "strict", *flags.split())
    yield srv
    _finish(srv)


@pytest.fixture(scope="module")
def model(server) -> str:
    """The served model name, as /v1/models lists it."""
    resp = httpx.get(server.url + "/v1/models", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="dummy", max_retries=0, timeout=120)


def _async_client(srv: ServerProcess, key: str = "dummy") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def tokenizer():
    from nanovllm.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


# ---- helpers ----------------------------------------------------------------------------------


def _error_of(resp: httpx.Response, status: int, srv: ServerProcess) -> dict:
    """The OpenAI-style error object of a response that must have `status`."""
    assert resp.status_code == status, (
        f"expected HTTP {status}, got {resp.status_code}: {resp.text[:500]}\n"
        f"server log:\n{srv.log_tail(15)}"
    )
    assert "Traceback" not in resp.text and 'File "' not in resp.text, resp.text
    try:
        body = resp.json()
    except ValueError:
        raise AssertionError(f"HTTP {status} body is not JSON: {resp.text[:300]!r}") from None
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    missing = {"message", "type", "param", "code"} - set(err)
    assert not missing, f"error body lacks {missing}: {body}"
    assert isinstance(err["message"], str) and err["message"], body
    return err


def _scrape(srv: ServerProcess) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label items: value}, from /metrics via prometheus_client."""
    resp = httpx.get(srv.url + "/metrics", timeout=10)
    assert resp.status_code == 200, resp.text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def _metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` (or `name_total`) whose labels include `labels`."""
    for key in (name, name + "_total"):
        if key in samples:
            return sum(v for ls, v in samples[key].items() if set(labels.items()) <= set(ls))
    raise AssertionError(f"/metrics has no {name}; it has: {sorted(samples)}")


def _finished(samples: dict, reason: str) -> float:
    key = "nanovllm:request_success"
    if key not in samples and key + "_total" not in samples:
        return _metric(samples, key)  # raises with the list of names
    return _metric(samples, key, finished_reason=reason)


def _wait_idle(srv: ServerProcess, timeout: float = 15.0) -> dict:
    """Poll /metrics until nothing runs or waits and every KV block is free; the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = _scrape(srv)
        running = _metric(m, "nanovllm:num_requests_running")
        waiting = _metric(m, "nanovllm:num_requests_waiting")
        free = _metric(m, "nanovllm:num_free_kv_blocks")
        total = _metric(m, "nanovllm:num_kv_blocks")
        if running == 0 and waiting == 0 and free == total:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(
                f"engine not idle {timeout:.0f} s later: running={running} waiting={waiting} "
                f"free KV blocks {free} of {total}\n{srv.log_tail(15)}"
            )
        time.sleep(0.1)


def _read_completion_stream(stream) -> tuple[dict, dict, object, int]:
    """Texts and finish reasons by choice index, the usage chunk, and the chunk count."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage, count = None, 0
    for chunk in stream:
        count += 1
        assert chunk.object == "text_completion", chunk
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.text or "")
            if c.finish_reason is not None:
                assert reasons.get(c.index) is None, f"choice {c.index} finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage, count


def _read_chat_stream(stream) -> tuple[dict, dict, object, list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage, pieces = None, []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.index not in texts:
                assert c.delta.role == "assistant", f"first delta of a choice: {c.delta}"
            piece = c.delta.content or ""
            pieces.append(piece)
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert reasons.get(c.index) is None, f"choice {c.index} finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage, pieces


def _tokenize(srv: ServerProcess, model: str, prompt: str) -> list[int]:
    resp = httpx.post(srv.url + "/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["count"] == len(body["tokens"]), body
    return body["tokens"]


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
    ids = _tokenize(server, model, text)
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
    texts, reasons, usage, chunks = _read_completion_stream(
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
    texts, reasons, _, pieces = _read_chat_stream(stream)
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
    ids = _tokenize(server, model, COUNTING)
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
    texts, reasons, _, pieces = _read_chat_stream(client.chat.completions.create(stream=True, **kw))
    assert texts == {0: want}, f"streamed pieces {pieces} != {want!r}"
    assert reasons == {0: "stop"}
    assert not any(cut in p for p in pieces)


def test_completion_stop_string_streamed(server, client, model):
    kw = dict(model=model, prompt=COUNTING, max_tokens=16, stop=[" 8,"], **GREEDY)
    got = client.completions.create(**kw).choices[0]
    assert got.text == " 5, 6, 7," and got.finish_reason == "stop", got
    texts, reasons, _, _ = _read_completion_stream(client.completions.create(stream=True, **kw))
    assert texts == {0: got.text} and reasons == {0: "stop"}


# ---- seeds, n > 1 -----------------------------------------------------------------------------


def test_seed_reproducible_sync_stream_and_under_load(server, client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=1234)
    first = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == first
    texts, _, _, _ = _read_completion_stream(client.completions.create(stream=True, **kw))
    assert texts == {0: first}

    async def under_load() -> str:
        async with _async_client(server) as aclient:
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
    streamed, reasons, _, _ = _read_completion_stream(client.completions.create(stream=True, **kw))
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
    assert resp.usage.prompt_tokens == len(_tokenize(server, model, prompt))
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


# ---- errors -----------------------------------------------------------------------------------

BAD_VALUES = [
    ("temperature", -1.0),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -5),
    ("min_p", 2.0),
    ("max_tokens", 0),
    ("presence_penalty", 3.0),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("n", 0),
    ("n", 10_000),  # n too large
    ("logprobs", -1),
]


@pytest.mark.parametrize("param, value", BAD_VALUES, ids=[f"{p}={v}" for p, v in BAD_VALUES])
def test_invalid_sampling_value_is_400_with_param(server, model, param, value):
    body = {"model": model, "prompt": "Hi", "max_tokens": 4, param: value}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    err = _error_of(resp, 400, server)
    assert err["param"] == param, err


@pytest.mark.parametrize(
    "param, value", [("max_tokens", "ten"), ("temperature", "hot"), ("stop", 5), ("n", 1.5)]
)
def test_wrong_type_is_400(server, model, param, value):
    body = {"model": model, "prompt": "Hi", param: value}
    err = _error_of(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 400, server)
    assert err["param"] == param or param in err["message"], err


def test_chat_invalid_values(server, model):
    url = server.url + "/v1/chat/completions"
    bad = {"model": model, "messages": FRANCE, "logprobs": True, "top_logprobs": -1}
    assert _error_of(httpx.post(url, json=bad, timeout=30), 400, server)["param"] == "top_logprobs"
    for body in (
        {"model": model},  # no messages
        {"model": model, "messages": "hello"},
        {"model": model, "messages": [{"content": "no role"}]},
    ):
        _error_of(httpx.post(url, json=body, timeout=30), 400, server)


@pytest.mark.parametrize(
    "path, content",
    [
        ("/v1/completions", b'{"model": "x", "prompt": '),
        ("/v1/chat/completions", b"not json at all"),
        ("/v1/completions", b"[1, 2, 3]"),
        ("/v1/completions", b"{}"),  # no prompt
    ],
)
def test_malformed_body_is_400(server, path, content):
    resp = httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}
    )
    _error_of(resp, 400, server)


def test_unknown_model_is_404(server, client):
    body = {"model": "no-such-model", "prompt": "Hi", "max_tokens": 2}
    err = _error_of(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 404, server)
    assert "no-such-model" in err["message"], err
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=FRANCE, max_tokens=2)


def test_prompt_longer_than_context_is_400(server, client, model):
    long_prompt = "hello " * (MAX_MODEL_LEN + 100)
    body = {"model": model, "prompt": long_prompt, "max_tokens": 2}
    err = _error_of(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 400, server)
    assert str(MAX_MODEL_LEN) in err["message"], f"the message should state the limit: {err}"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": long_prompt}], max_tokens=2
        )
    assert e.value.status_code == 400
    ids = _tokenize(server, model, "hi")
    body = {"model": model, "prompt": ids + [10**7], "max_tokens": 2}  # not in the vocabulary
    _error_of(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 400, server)


def test_body_too_large_is_413(server, model):
    body = json.dumps({"model": model, "prompt": "x" * (MAX_REQUEST_BYTES + 1000)}).encode()
    url = server.url + "/v1/completions"
    headers = {"content-type": "application/json"}
    _error_of(httpx.post(url, content=body, headers=headers, timeout=30), 413, server)

    def chunked():  # no Content-Length: the limit must hold while reading too
        for i in range(0, len(body), 16384):
            yield body[i : i + 16384]

    _error_of(httpx.post(url, content=chunked(), headers=headers, timeout=30), 413, server)


def test_errors_do_not_disturb_others(server, model):
    """A live stream completes correctly while a barrage of bad requests is refused."""
    kw = dict(model=model, prompt=COUNTING, max_tokens=16, **GREEDY)
    bad_bodies = [
        {"model": model, "prompt": "Hi", "temperature": -1},
        {"model": "nope", "prompt": "Hi"},
        {"model": model, "prompt": "hello " * 600},
        {"model": model, "prompt": "Hi", "n": 10_000},
    ]

    async def run() -> tuple[str, str, list[int]]:
        async with _async_client(server) as aclient, httpx.AsyncClient(timeout=60) as h:
            ref = (await aclient.completions.create(**kw)).choices[0].text
            stream = await aclient.completions.create(stream=True, **kw)
            statuses = []
            text = ""
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
                if not statuses:
                    posts = [h.post(server.url + "/v1/completions", json=b) for b in bad_bodies]
                    posts.append(h.post(server.url + "/v1/chat/completions", content=b"{"))
                    statuses = [r.status_code for r in await asyncio.gather(*posts)]
            return ref, text, statuses

    ref, text, statuses = asyncio.run(run())
    assert statuses == [400, 404, 400, 400, 400]
    assert text == ref
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---- metrics ----------------------------------------------------------------------------------


def test_metrics_move(server, client, model):
    before = _wait_idle(server)
    for name in (
        "nanovllm:num_requests_running",
        "nanovllm:num_requests_waiting",
        "nanovllm:kv_cache_usage_perc",
        "nanovllm:prefix_cache_queries",
        "nanovllm:prefix_cache_hits",
        "nanovllm:num_preemptions",
    ):
        _metric(before, name)
    assert _metric(before, "nanovllm:kv_cache_usage_perc") == 0
    prompt = "Tell me about otters."  # < one block: no prefix-cache hit to muddy the counts
    n_prompt = len(_tokenize(server, model, prompt))
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    _, reasons, _, _ = _read_completion_stream(stream)
    assert reasons == {0: "length"}
    after = _wait_idle(server)

    def delta(name: str) -> float:
        return _metric(after, name) - _metric(before, name)

    assert delta("nanovllm:prompt_tokens") == n_prompt
    assert delta("nanovllm:generation_tokens") == 5
    assert _finished(after, "length") - _finished(before, "length") == 1
    for h in (
        "nanovllm:time_to_first_token_seconds",
        "nanovllm:time_per_output_token_seconds",
        "nanovllm:e2e_request_latency_seconds",
        "nanovllm:request_queue_time_seconds",
    ):
        assert h + "_bucket" in after, f"/metrics has no histogram {h}: {sorted(after)}"
        assert delta(h + "_count") >= 1, f"{h} did not observe the streamed request"


# ---- cancellation, timeouts -------------------------------------------------------------------


def test_non_streamed_request_aborted_on_disconnect(server, model):
    before = _wait_idle(server)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and hangs up
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(1.0))
    # 400 CPU tokens take ~15 s; an aborted request frees its blocks within a step
    after = _wait_idle(server, timeout=6.0)
    assert time.monotonic() - t0 < 10
    assert _finished(after, "abort") - _finished(before, "abort") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_timeout_finishes_request(server, client, model, stream):
    before = _wait_idle(server)
    kw = dict(
        model=model,
        prompt="Once upon a time",
        max_tokens=400,
        extra_body={"ignore_eos": True, "timeout": 0.5},
    )
    t0 = time.monotonic()
    if stream:
        texts, reasons, _, _ = _read_completion_stream(client.completions.create(stream=True, **kw))
        reason, text = reasons[0], texts[0]
    else:
        resp = client.completions.create(**kw)
        reason, text = resp.choices[0].finish_reason, resp.choices[0].text
        assert 0 < resp.usage.completion_tokens < 400, resp.usage
    elapsed = time.monotonic() - t0
    assert reason == "timeout", f"finish_reason {reason!r} after {elapsed:.1f} s"
    assert elapsed < 6.0, f"a 0.5 s timeout took {elapsed:.1f} s"
    assert text, "the text generated before the timeout is returned"
    after = _wait_idle(server, timeout=5.0)
    assert _finished(after, "timeout") - _finished(before, "timeout") == 1


def test_logs_one_line_per_finished_request(server, client, model):
    resp = client.completions.create(model=model, prompt=COUNTING, max_tokens=3, **GREEDY)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [ln for ln in server.log_path.read_text().splitlines() if resp.id in ln]
        if lines:
            break
        time.sleep(0.1)
    assert len(lines) == 1, f"log lines naming {resp.id}: {lines}\n{server.log_tail(10)}"
    assert "length" in lines[0], lines[0]


# ---- concurrency ------------------------------------------------------------------------------

SUBJECTS = ["cats", "the moon", "rivers", "bread", "winter", "robots", "music", "trees"]
TASKS = [
    "Describe {} in one sentence.",
    "Write a short poem about {}.",
    "Give one fact about {}.",
    "Why do people like {}?",
    "What color are {}?",
    "Tell a joke about {}.",
    "List two things about {}.",
    "Explain {} to a child.",
]
NUM_CLIENTS = 64


def _concurrent_requests() -> list[dict]:
    """64 requests: even ones chat, odd ones completions; every fourth hangs up early."""
    reqs = []
    for i in range(NUM_CLIENTS):
        question = TASKS[i % 8].format(SUBJECTS[i // 8])
        drop = i % 4 == 3
        req = dict(
            kind="chat" if i % 2 == 0 else "completion",
            drop=drop,
            max_tokens=300 if drop else 4 + (i * 7) % 21,  # 4..24; droppers would run long
        )
        if req["kind"] == "chat":
            req["messages"] = [{"role": "user", "content": question}]
        else:
            req["prompt"] = f"Question: {question}\nAnswer:"
        reqs.append(req)
    return reqs


async def _one(aclient, model: str, req: dict, stream: bool) -> tuple[str, str | None]:
    extra = {"ignore_eos": True} if req["drop"] else None
    kw = dict(model=model, max_tokens=req["max_tokens"], temperature=0.0, extra_body=extra)
    if req["kind"] == "chat":
        create, kw["messages"] = aclient.chat.completions.create, req["messages"]
    else:
        create, kw["prompt"] = aclient.completions.create, req["prompt"]

    def piece(choice) -> str:
        return (choice.delta.content or "") if req["kind"] == "chat" else (choice.text or "")

    if not stream:
        resp = await create(**kw)
        c = resp.choices[0]
        return (c.message.content if req["kind"] == "chat" else c.text), c.finish_reason
    text, reason, chunks = "", None, 0
    s = await create(stream=True, **kw)
    async for chunk in s:
        chunks += 1
        for c in chunk.choices:
            text += piece(c)
            reason = c.finish_reason or reason
        if req["drop"] and (text or chunks >= 3):
            await s.close()  # hang up mid-stream
            return text, "dropped"
    return text, reason


def test_concurrent_streams_with_disconnects(server, model):
    reqs = _concurrent_requests()
    keep = [i for i, r in enumerate(reqs) if not r["drop"]]

    async def run():
        async with _async_client(server) as aclient:
            refs = await asyncio.gather(*(_one(aclient, model, reqs[i], False) for i in keep))
            before = _wait_idle(server)
            t0 = time.monotonic()
            outs = await asyncio.wait_for(
                asyncio.gather(*(_one(aclient, model, r, True) for r in reqs)), timeout=300
            )
            return dict(zip(keep, refs)), outs, before, time.monotonic() - t0

    refs, outs, before, elapsed = asyncio.run(run())
    wrong = [
        f"#{i} ({reqs[i]['kind']}, max_tokens {reqs[i]['max_tokens']}): streamed {outs[i]!r}, "
        f"alone {refs[i]!r}"
        for i in keep
        if outs[i] != refs[i]
    ]
    assert not wrong, f"{len(wrong)} of {len(keep)} streams differ:\n" + "\n".join(wrong)
    assert all(outs[i][1] == "dropped" for i, r in enumerate(reqs) if r["drop"])
    after = _wait_idle(server, timeout=15.0)  # every KV block back once the droppers abort
    dropped = NUM_CLIENTS - len(keep)
    assert _finished(after, "abort") - _finished(before, "abort") == dropped
    done = sum(_finished(after, r) - _finished(before, r) for r in ("stop", "length"))
    assert done == len(keep)
    print(f"{NUM_CLIENTS} concurrent streams in {elapsed:.1f} s")


# ---- access and admission (the strict server) -------------------------------------------------


def test_api_key_required_on_v1(strict_server, model):
    url = strict_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        _error_of(httpx.get(url + "/v1/models", headers=headers, timeout=10), 401, strict_server)
        body = {"model": model, "prompt": "Hi", "max_tokens": 2}
        resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
        _error_of(resp, 401, strict_server)
    ok = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(url + "/v1/models", headers=ok, timeout=10).status_code == 200
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # not a /v1 route
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    resp = good.completions.create(model=model, prompt=COUNTING, max_tokens=3, **GREEDY)
    assert resp.usage.completion_tokens == 3


def test_overload_gets_429_quickly(strict_server, model):
    total, max_tokens = 12, 40
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def one(h: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = await h.post(strict_server.url + "/v1/completions", json=body, headers=headers)
        return r, time.monotonic() - t0

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as h:
            return await asyncio.gather(*(one(h) for _ in range(total)))

    results = asyncio.run(run())
    statuses = sorted(r.status_code for r, _ in results)
    admitted = [(r, t) for r, t in results if r.status_code == 200]
    refused = [(r, t) for r, t in results if r.status_code == 429]
    assert len(admitted) + len(refused) == total, f"statuses {statuses}"
    assert STRICT_WAITING <= len(admitted) <= STRICT_SEQS + STRICT_WAITING, f"statuses {statuses}"
    for r, t in refused:
        _error_of(r, 429, strict_server)
        assert float(r.headers.get("retry-after", "nan")) > 0, f"Retry-After: {r.headers}"
        assert t < 3.0, f"a 429 took {t:.1f} s"
    slowest_refusal = max(t for _, t in refused)
    assert slowest_refusal < min(t for _, t in admitted), "refusals should not wait for work"
    print(
        f"overload: {len(admitted)} admitted, {len(refused)} refused in <= {slowest_refusal:.2f} s"
    )
    for r, _ in admitted:
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == max_tokens, r.json()
    good = openai.OpenAI(base_url=strict_server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model=model, prompt="Hi", max_tokens=2).choices  # still serves


def test_priority_orders_waiting_and_preempts(strict_server, model):
    """Two long priority-5 requests fill both rows; then a priority-9 request waits and a
    priority-0 one arrives after it: it preempts a priority-5 row and finishes first, and the
    priority-9 one, though earlier, starts only when a row frees."""
    order: list[str] = []
    first_token: dict[str, asyncio.Event] = {}

    async def stream(aclient, name: str, priority: int, max_tokens: int) -> None:
        first_token[name] = asyncio.Event()
        s = await aclient.completions.create(
            model=model,
            prompt=f"Request {name}: once upon a time",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"priority": priority, "ignore_eos": True},
        )
        async for _ in s:
            first_token[name].set()
        order.append(name)

    async def run() -> None:
        async with _async_client(strict_server, API_KEY) as aclient:
            tasks = [asyncio.create_task(stream(aclient, f"long{i}", 5, 60)) for i in range(2)]
            while len(first_token) < 2:
                await asyncio.sleep(0.01)
            await asyncio.wait_for(
                asyncio.gather(*(first_token[f"long{i}"].wait() for i in range(2))), 120
            )
            tasks.append(asyncio.create_task(stream(aclient, "low", 9, 8)))
            await asyncio.sleep(0.5)  # "low" is queued before "high" arrives
            tasks.append(asyncio.create_task(stream(aclient, "high", 0, 8)))
            await asyncio.wait_for(asyncio.gather(*tasks), 300)

    before = _wait_idle(strict_server)
    asyncio.run(run())
    after = _wait_idle(strict_server)
    assert order[0] == "high", f"finish order {order}: priority 0 should preempt and finish first"
    assert order.index("low") >= 2, f"finish order {order}: priority 9 should wait for a row"
    preemptions = _metric(after, "nanovllm:num_preemptions")
    assert preemptions > _metric(before, "nanovllm:num_preemptions"), "no preemption counted"


def test_dead_engine_fails_health_and_shutdown_is_clean(strict_server, model):
    """Last test of the strict server: kill its engine process."""
    os.kill(strict_server.engine_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 10
    status = 200
    while time.monotonic() < deadline and status == 200:
        status = httpx.get(strict_server.url + "/health", timeout=5).status_code
        time.sleep(0.1)
    assert status != 200, "/health still 200 10 s after the engine process died"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": model, "prompt": "Hi", "max_tokens": 2}
    resp = httpx.post(strict_server.url + "/v1/completions", json=body, headers=headers, timeout=10)
    assert resp.status_code >= 500, f"a request to a dead engine got {resp.status_code}"
    _error_of(resp, resp.status_code, strict_server)  # still OpenAI's shape, no traceback
