"""`nanovllm serve --api-server-count 2`: two front-end processes accept on one port (a
socket each on Linux), each with its own pipe to every engine process. Requests through
either are answered (streamed or not, by the official client), abandoned streams free their
blocks, /metrics sums both processes' latency histograms whichever answers the scrape, and
when the engine dies every front end exits: the server with status 1, no process left
behind."""

import concurrent.futures
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import openai

from nanovllm.entrypoints.openai.sockets import listening_sockets
from tests.server.harness import ServerProcess, metric, scrape, wait_idle
from tests.support import build_tiny_model

E2E = "nanovllm:e2e_request_latency_seconds"


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def two_front_ends(model: Path, tmp_path: Path, *args: str) -> tuple[ServerProcess, list[int]]:
    """A ready server of two front ends, and their pids: the server's own process and the
    one it started."""
    srv = ServerProcess(tmp_path / "server.log", "--model", str(model),
                        "--api-server-count", "2", *args)
    srv.wait_ready()
    spawned = re.findall(r"front end \d+: process (\d+)", srv.log_path.read_text())
    pids = [srv.proc.pid, *map(int, spawned)]
    assert len(pids) == 2, srv.log_tail()
    return srv, pids


def test_each_front_end_listens_on_a_socket_of_its_own():
    """On Linux each front end gets its own socket, all on one port with SO_REUSEPORT, and
    the kernel spreads a burst of connections over them by address: none takes the whole
    queue, as a process could from one shared socket. Elsewhere they share one socket."""
    socks = listening_sockets("127.0.0.1", 0, 2)
    clients = []
    try:
        if not sys.platform.startswith("linux"):
            assert socks[0] is socks[1]
            return
        assert socks[0] is not socks[1]
        port = socks[0].getsockname()[1]
        assert socks[1].getsockname()[1] == port
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in socks)
        for s in socks:
            s.listen(1024)
            s.setblocking(False)
        for _ in range(400):  # the kernel completes each handshake before any accept
            clients.append(socket.create_connection(("127.0.0.1", port)))
        counts = [0, 0]
        for i, s in enumerate(socks):
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                counts[i] += 1
        assert sum(counts) == 400 and min(counts) >= 100, counts
    finally:
        for c in clients:
            c.close()
        for s in set(socks):
            s.close()


def test_a_port_taken_before_the_front_ends_bind_is_a_clear_error():
    """A port another process took after the start-up check: a ConfigError that says what
    to change, not an OSError's traceback."""
    import pytest

    from nanovllm.core.errors import ConfigError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match="pick another --port"):
            listening_sockets("127.0.0.1", port, 2)


def test_two_front_ends_serve_two_replicas_and_share_metrics(tiny_llama, tmp_path):
    """With two engine replicas too (--data-parallel-size 2): each front end has a pipe to
    each replica. Streams closed after their first token free their blocks whichever front
    end and replica served them."""
    # contexts of 16,384: an abandoned stream of 8,000 tokens would run for seconds
    model_dir = build_tiny_model(tmp_path / "model", "llama", max_position_embeddings=16384)
    srv, pids = two_front_ends(model_dir, tmp_path, "--data-parallel-size", "2",
                               "--max-model-len", "16384")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        model = client.models.list().data[0].id
        before, ticks = wait_idle(srv), [cpu_ticks(p) for p in pids]

        def one(i: int) -> int:
            # a fresh connection each time: the kernel hands each to either process
            with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60) as c:
                kw = dict(model=model, prompt=[5, 6, 7, 10 + i % 40], max_tokens=6,
                          temperature=0, extra_body={"ignore_eos": True})
                if i % 2:
                    chunks = list(c.completions.create(stream=True, **kw))
                    return sum(len(ch.choices[0].text) > 0 for ch in chunks if ch.choices)
                return c.completions.create(**kw).usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, range(48)))
        assert all(n > 0 for n in got) and got[0::2] == [6] * 24, got
        after = wait_idle(srv)
        # every request observed once, in one process or the other, all in one scrape
        assert metric(after, E2E + "_count") - metric(before, E2E + "_count") == 48
        assert metric(after, "nanovllm:generation_tokens") - metric(
            before, "nanovllm:generation_tokens") == 48 * 6
        used = [cpu_ticks(p) - t for p, t in zip(pids, ticks)]
        assert all(u > 0 for u in used), f"a front end served nothing: CPU ticks {used}"
        assert metric(scrape(srv), E2E + "_count") == metric(after, E2E + "_count")
        served = [metric(after, "nanovllm:request_success", replica=r) for r in "01"]
        assert all(n > 0 for n in served), f"a replica served nothing: {served}"

        def abandon(i: int) -> None:
            with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60) as c:
                stream = c.completions.create(model=model, prompt=[8, 9, i + 10], stream=True,
                                              max_tokens=16000, extra_body={"ignore_eos": True})
                next(iter(stream))
                stream.close()

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(abandon, range(16)))
        # each ends as an abort, not at its length: on a loaded 2-core machine a front end
        # may take seconds to see its client gone, far less than 16,000 tokens take
        base = metric(after, "nanovllm:request_success", finished_reason="abort")
        deadline = time.monotonic() + 90
        while (aborts := metric(scrape(srv), "nanovllm:request_success",
                                finished_reason="abort") - base) < 16:
            assert time.monotonic() < deadline, f"{aborts:.0f} of 16 streams aborted"
            time.sleep(0.2)
        wait_idle(srv, timeout=30)  # every block free again
    finally:
        problems = srv.stop(timeout=20)  # SIGTERM: both front ends stop, then the engine
    assert not problems, problems
    assert not srv.log_problems(), srv.log_tail()


def test_an_engine_death_ends_every_front_end(tiny_llama, tmp_path):
    srv, pids = two_front_ends(tiny_llama, tmp_path, "--max-model-len", "512")
    try:
        engine = next(p for p in srv.descendants() if p not in pids and b"spawn_main"
                      in Path(f"/proc/{p}/cmdline").read_bytes())
        srv.known_children |= set(srv.descendants())
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        assert srv.proc.wait(30) == 1, srv.log_tail()
        assert time.monotonic() - killed < 20
        log = srv.log_path.read_text()
        assert "exiting with status 1" in log and "Traceback" not in log, log[-3000:]
    finally:
        problems = srv.stop(timeout=10)  # the harness checks that no process is left
        assert not problems, problems
