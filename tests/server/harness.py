"""The server test harness: `python -m nanovllm serve` in a subprocess (ServerProcess) and
helpers to read its errors, metrics, streams and logs. Fixtures are in conftest.py."""

import ctypes
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 16
MAX_REQUEST_BYTES = 200_000
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
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}  # for scrape()
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

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_problems(self, since: int = 0) -> list[str]:
        """Log lines after byte `since` that report an error or a traceback: a request,
        however hostile, must never cause one."""
        with open(self.log_path, "rb") as f:
            f.seek(since)
            lines = f.read().decode(errors="replace").splitlines()
        return [ln for ln in lines if re.search(r"\bERROR\b|CRITICAL|Traceback", ln)]

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


def start_server(tmp_path_factory, name: str, *args: str, env: dict | None = None):
    srv = ServerProcess(tmp_path_factory.mktemp(name) / "server.log", *args, env=env)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop(timeout=5.0)
        raise
    return srv


def stop_server(srv: ServerProcess) -> None:
    """Stop `srv`; it must shut down cleanly and have logged no error or traceback in its
    whole life."""
    problems = srv.stop()
    assert not problems, "unclean shutdown: " + "; ".join(problems) + "\n" + srv.log_tail()
    errors = srv.log_problems()
    assert not errors, f"the server logged {len(errors)} errors:\n" + "\n".join(errors[:20])


def async_client(srv: ServerProcess, key: str = "dummy") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=180)


# ---- helpers ----------------------------------------------------------------------------------


def error_of(resp: httpx.Response, status: int, srv: ServerProcess) -> dict:
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


def scrape(srv: ServerProcess) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label items: value}, from /metrics via prometheus_client."""
    resp = httpx.get(srv.url + "/metrics", headers=srv.auth, timeout=10)
    assert resp.status_code == 200, resp.text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` (or `name_total`) whose labels include `labels`."""
    for key in (name, name + "_total"):
        if key in samples:
            return sum(v for ls, v in samples[key].items() if set(labels.items()) <= set(ls))
    raise AssertionError(f"/metrics has no {name}; it has: {sorted(samples)}")


def finished(samples: dict, reason: str) -> float:
    key = "nanovllm:request_success"
    if key not in samples and key + "_total" not in samples:
        return metric(samples, key)  # raises with the list of names
    return metric(samples, key, finished_reason=reason)


def wait_idle(srv: ServerProcess, timeout: float = 15.0) -> dict:
    """Poll /metrics until nothing runs or waits and every KV block is free; the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(srv)
        running = metric(m, "nanovllm:num_requests_running")
        waiting = metric(m, "nanovllm:num_requests_waiting")
        free = metric(m, "nanovllm:num_free_kv_blocks")
        total = metric(m, "nanovllm:num_kv_blocks")
        if running == 0 and waiting == 0 and free == total:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(
                f"engine not idle {timeout:.0f} s later: running={running} waiting={waiting} "
                f"free KV blocks {free} of {total}\n{srv.log_tail(15)}"
            )
        time.sleep(0.1)


def read_completion_stream(stream) -> tuple[dict, dict, object, int]:
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


def read_chat_stream(stream) -> tuple[dict, dict, object, list]:
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


def tokenize(srv: ServerProcess, model: str, prompt: str) -> list[int]:
    resp = httpx.post(srv.url + "/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["count"] == len(body["tokens"]), body
    return body["tokens"]


def post(srv: ServerProcess, path: str, body: dict) -> dict:
    """POST `body` to `path`; the JSON answer, which must be a 200 (fields beyond OpenAI's,
    such as stop_reason, as the server wrote them)."""
    resp = httpx.post(srv.url + path, json=body, headers=srv.auth, timeout=120)
    assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:500]}"
    return resp.json()


@functools.cache
def offline_llm():
    """The default model as `LLM` in this test process, with the session server's settings
    (CPU, max_model_len, max_num_seqs, dense weights): what a request over HTTP must equal
    offline. Loaded once per process; a small KV cache, as these references are a few short
    prompts. (Packed weights round activations to bfloat16, so a prefill split otherwise by
    the prefix cache can move a logprob by ~1e-3; dense float32 keeps them equal to 1e-4.)"""
    from nanovllm import LLM

    return LLM(device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
               num_kv_blocks=128, weight_format="dense")


def pause_front_end(srv: ServerProcess, seconds: float) -> None:
    """Stop the HTTP front end (SIGSTOP) for `seconds` while the engine process runs on: the
    Deltas it sends meanwhile pile up and reach the front end merged, several tokens each.
    The front end is continued whatever happens, so the server is never left stopped."""
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
