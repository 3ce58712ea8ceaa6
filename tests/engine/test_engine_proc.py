"""The server's engine process, driven over its pipe without HTTP: streamed deltas add up
to the offline text, stop strings are never leaked, aborts and timeouts free every block,
and a full waiting queue rejects as overloaded, with a retry time."""

import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.core.config import EngineConfig
from nanovllm.engine.engine_proc import start_engine
from nanovllm.engine.messages import (
    AbortRequest,
    Accepted,
    AddRequest,
    Delta,
    EngineProcessConfig,
    Load,
    OutputRows,
    Outputs,
    Ready,
    Rejected,
    RejectReason,
    Shutdown,
    StatsQuery,
    StatsReply,
)
from nanovllm.engine.outbox import Outbox

# a cache of 1,024 blocks: the CPU default at block_size 4 is a million, seconds to set up
ENGINE = dict(device="cpu", block_size=4, num_kv_blocks=1024, max_num_seqs=4,
              max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    proc, (conn,) = start_engine(EngineProcessConfig(str(tiny_llama), EngineConfig(**ENGINE), 4))
    assert conn.poll(120), "engine did not start"
    ready = conn.recv()
    assert isinstance(ready, Ready), ready
    yield conn, ready.info
    conn.send(Shutdown())
    proc.join(10)
    if proc.is_alive():
        proc.kill()


def collect(conn, ids, until_done=True, timeout=60.0):
    """Read messages until every request in `ids` has finished (or been answered)."""
    deltas: dict[str, list] = {i: [] for i in ids}
    replies: dict[str, Accepted | Rejected] = {}
    open_ = set(ids)
    end = time.monotonic() + timeout
    while open_ and time.monotonic() < end:
        if not conn.poll(0.5):
            continue
        match conn.recv():
            case Accepted(request_id=rid) as reply:
                replies[rid] = reply
            case Rejected(request_id=rid) as reply:
                replies[rid] = reply
                open_.discard(rid)
            case Outputs(deltas=deltas_):
                for d in deltas_:
                    if d.request_id not in deltas:  # e.g. a step of one aborted meanwhile
                        continue
                    deltas[d.request_id].append(d)
                    if d.finish_reason is not None:
                        open_.discard(d.request_id)
    assert not open_, f"requests never finished: {open_}"
    return deltas, replies


def stats(conn):
    conn.send(StatsQuery(0))
    while True:
        msg = conn.recv()
        if isinstance(msg, StatsReply):
            return msg.stats


def test_streamed_deltas_equal_offline_text_and_hold_back_stop_prefixes(engine, tiny_llama):
    conn, info = engine
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = LLM(str(tiny_llama), **ENGINE).generate(prompts, params, use_tqdm=False)
    # a stop string taken from the middle of one offline text: it must end that request
    stop = offline[0].text[4:7]
    for i, p in enumerate(prompts):
        conn.send(AddRequest(f"s{i}", p, params, stream=True))
    conn.send(AddRequest("stop", prompts[0], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]), stream=True))
    deltas, replies = collect(conn, ["s0", "s1", "s2", "stop"])
    # a stream the front end decodes itself: ids only (the engine does not decode it)
    conn.send(AddRequest("ids", prompts[1], params, detokenize=False))
    deltas |= collect(conn, ["ids"])[0]
    assert all(isinstance(r, Accepted) for r in replies.values())
    for i, out in enumerate(offline):
        ds = deltas[f"s{i}"]
        assert "".join(d.text for d in ds) == out.text
        assert sum(len(d.token_ids) for d in ds) == len(out.token_ids) == 12
        assert ds[-1].finish_reason == "length" and ds[0].queue_time is not None
    assert [t for d in deltas["ids"] for t in d.token_ids] == offline[1].token_ids
    assert all(d.text == "" for d in deltas["ids"])
    stopped = deltas["stop"]
    text = "".join(d.text for d in stopped)
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop
    assert text == offline[0].text[: offline[0].text.find(stop)]
    shown = ""
    for d in stopped:  # no prefix of the stop string was ever shown and later cut
        shown += d.text
        assert text.startswith(shown)


def test_abort_timeout_and_backpressure_free_every_block(engine):
    conn, info = engine
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    conn.send(AddRequest("a", [1, 2, 3], long))
    conn.send(AddRequest("t", [4, 5, 6], long, timeout=0.0))
    conn.send(AbortRequest("a"))
    deltas, _ = collect(conn, ["t"])
    assert deltas["t"][-1].finish_reason == "timeout"
    # fill every running row, then the waiting queue (4), then one more is refused
    for i in range(12):
        conn.send(AddRequest(f"q{i}", [7, 8, 9], long, stream=False))
    seen: dict[str, Accepted | Rejected] = {}
    end = time.monotonic() + 30
    while len(seen) < 12 and time.monotonic() < end:
        if conn.poll(0.5):
            msg = conn.recv()
            if isinstance(msg, Accepted | Rejected):
                seen[msg.request_id] = msg
    rejected = [m for m in seen.values() if isinstance(m, Rejected)]
    assert rejected and all(
        m.reason is RejectReason.OVERLOADED and "max-num-waiting" in m.message for m in rejected
    )
    assert all(1 <= m.retry_after <= 60 for m in rejected)  # Retry-After seconds
    for rid, m in seen.items():
        if isinstance(m, Accepted):
            conn.send(AbortRequest(rid))
    s = stats(conn)
    assert s.num_free_kv_blocks == s.num_kv_blocks == info.num_kv_blocks
    assert s.num_requests_running == s.num_requests_waiting == 0
    assert s.finished["abort"] >= 1 and s.finished["timeout"] == 1


def test_gc_pauses_count_each_generations_collections():
    """GcPauses adds a collection's pause to its generation's total, and stops at close."""
    import gc

    from nanovllm.engine.step_times import GcPauses

    pauses = GcPauses()
    try:
        gc.collect(2)
        gc.collect(0)
        assert pauses.totals["2"] > 0 and pauses.totals["0"] > 0
    finally:
        pauses.close()
    before = dict(pauses.totals)
    gc.collect(2)
    assert pauses.totals == before


def test_outputs_cross_the_pipe_field_for_field():
    """Outputs, and the engine's OutputRows (rows of Delta's fields), pickle by columns (a
    list per field) and arrive as Outputs: every field of every Delta as it was, in order,
    whatever it holds (text, logprobs, a finish, nothing)."""
    import pickle

    rows = [(f"r{i}", i % 3, "é" * i, [i, 7], [{i: -0.5}] if i % 2 else None,
             "stop" if i == 4 else None, "\n" if i == 4 else None, i, 0.25 * i or None)
            for i in range(6)]
    for part in (rows, rows[:1], []):
        expected = Outputs([Delta(*row) for row in part])
        for msg in (expected, OutputRows(part)):
            back = pickle.loads(pickle.dumps(msg))
            assert back == expected and all(type(d) is Delta for d in back.deltas)


def test_outbox_never_blocks_the_engine_and_merges_what_waits():
    """The front end stops reading: queuing outputs still returns at once, and what piles
    up arrives later merged per completion, in order, nothing lost."""
    import multiprocessing
    import threading

    front, back = multiprocessing.Pipe(duplex=True)
    outbox = Outbox(back)
    piece = "x" * 1000  # 2 completions x 500 steps x 1 KB: far more than the pipe holds

    def engine():
        for step in range(500):
            last = step == 499
            outbox.put_deltas([
                ("a", i, f"{piece}{step};", [step], None, "length" if last else None,
                 None, 0, 0.5 if step == 0 else None)
                for i in range(2)
            ])

    t = threading.Thread(target=engine)
    t.start()
    t.join(10)
    assert not t.is_alive(), "queuing outputs blocked while the front end was not reading"
    assert outbox.pending  # the pipe filled up: the rest waits, merged

    texts, tokens, finish, outs = {0: "", 1: ""}, {0: [], 1: []}, {}, []

    def front_end():  # now the front end reads again, until both ended and the reply came
        ended, replied = 0, False
        while ended < 2 or not replied:
            msg = front.recv()
            if isinstance(msg, StatsReply):
                replied = True  # replies overtake waiting Deltas
                continue
            outs.append(msg)
            ended += sum(d.finish_reason is not None for d in msg.deltas)

    reader = threading.Thread(target=front_end)
    reader.start()
    outbox.send(StatsReply(1, None))
    while not outbox.flush(timeout=1.0):
        pass
    reader.join(10)
    assert not reader.is_alive()
    for msg in outs:
        for d in msg.deltas:
            texts[d.index] += d.text
            tokens[d.index] += d.token_ids
            if d.finish_reason:
                finish[d.index] = d.finish_reason
            assert d.queue_time == (0.5 if d.token_ids[0] == 0 else None)
    expected = "".join(f"{piece}{s};" for s in range(500))
    assert texts == {0: expected, 1: expected}
    assert tokens == {0: list(range(500)), 1: list(range(500))}
    assert finish == {0: "length", 1: "length"}
    assert len(outs) < 500  # merged: one message per step would be 500


def test_engine_keeps_reading_while_its_replies_wait(engine):
    """A front end that writes a long burst before reading anything: the engine's replies
    wait for room instead of blocking it, so it keeps reading and neither side deadlocks."""
    import threading

    conn, _ = engine
    n = 3000  # ~1.5 MB of stats replies, far more than the pipe holds
    sender = threading.Thread(target=lambda: [conn.send(StatsQuery(i)) for i in range(n)])
    sender.start()
    sender.join(30)
    assert not sender.is_alive(), "the engine stopped reading while its replies were unread"
    tokens = []
    while len(tokens) < n:
        msg = conn.recv()
        if isinstance(msg, StatsReply):
            tokens.append(msg.token)
    assert tokens == list(range(n))  # every reply, in order


def test_every_front_end_hears_the_engines_load(tiny_llama):
    """Two front ends' pipes: each gets the engine's Load while it works, counting the other
    front end's requests too, and a last one once it is idle; adds_seen counts the
    AddRequests taken from that pipe only."""
    config = EngineProcessConfig(str(tiny_llama), EngineConfig(**ENGINE), None)
    proc, conns = start_engine(config, num_front_ends=2)
    try:
        for conn in conns:
            assert conn.poll(120), "engine did not start"
            ready = conn.recv()
            assert isinstance(ready, Ready)
        a, b = conns
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i in range(6):  # 4 rows: 4 run, 2 wait
            a.send(AddRequest(f"a{i}", [1, 2, 3 + i], long, stream=False))
        b.send(AddRequest("b0", [4, 5, 6], long, stream=False))

        def loads(conn, requests: int) -> list[Load]:
            """Every Load on `conn` until its requests ended and a Load says idle."""
            got, ended = [], 0
            end = time.monotonic() + 60
            while time.monotonic() < end:
                if not conn.poll(0.5):
                    continue
                msg = conn.recv()
                if isinstance(msg, Outputs):
                    ended += sum(d.finish_reason is not None for d in msg.deltas)
                elif isinstance(msg, Load):
                    got.append(msg)
                    if ended == requests and msg.num_running == msg.num_waiting == 0:
                        return got
            raise AssertionError(f"no idle Load after {ended} of {requests} ended: {got[-3:]}")

        for conn, requests, sent in ((a, 6, 6), (b, 1, 1)):
            got = loads(conn, requests)
            assert max(m.num_running for m in got) == 4  # b hears a's requests too
            assert any(m.num_waiting > 0 for m in got)
            assert got[-1] == Load(0, 0, ready.info.num_kv_blocks, sent)
    finally:
        for conn in conns:
            conn.send(Shutdown())
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_a_front_end_gone_with_replies_unread_ends_the_engine_quietly(tiny_llama, capfd):
    """A front end that exits with the engine's replies still unread in its pipe (a stop
    that cancelled a stream at --drain-timeout) resets the pipe: the engine's next read or
    write gets ECONNRESET, not EOF, and it ends as for EOF, with status 0 and no traceback."""
    config = EngineProcessConfig(str(tiny_llama), EngineConfig(**ENGINE), None)
    proc, (conn,) = start_engine(config)
    try:
        assert conn.poll(120), "engine did not start"
        assert isinstance(conn.recv(), Ready)
        conn.send(AddRequest("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=400,
                                                            ignore_eos=True), stream=True))
        while not isinstance(conn.recv(), Outputs):  # streaming; then read nothing more
            pass
        time.sleep(0.5)  # more replies wait unread
        conn.close()
        proc.join(30)
        assert proc.exitcode == 0, proc.exitcode
    finally:
        if proc.is_alive():
            proc.kill()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]


def test_constraints_compile_in_the_background(engine):
    """A request with a new constraint is answered once it has compiled (Accepted, or
    Rejected naming the field), while a running request keeps stepping; one aborted while
    compiling is never queued."""
    from nanovllm.core.sampling_params import StructuredOutputsParams

    conn, _ = engine
    def so(**kind):
        return SamplingParams(max_tokens=12, temperature=1.0,
                              structured_outputs=StructuredOutputsParams(**kind))
    conn.send(AddRequest("free", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
    conn.send(AddRequest("json", [5, 6], so(regex="(ab|cd){2,5}")))
    conn.send(AddRequest("bad", [5, 6], so(regex="([a-z]+")))
    conn.send(AddRequest("gone", [5, 6], so(regex="x{3}y{2}")))
    conn.send(AbortRequest("gone"))
    deltas, replies = collect(conn, ["free", "json", "bad"])
    assert isinstance(replies["json"], Accepted) and isinstance(replies["free"], Accepted)
    bad = replies["bad"]
    assert isinstance(bad, Rejected) and bad.reason == RejectReason.INVALID
    assert bad.param == "structured_outputs.regex" and "does not compile" in bad.message
    import re

    text = "".join(d.text for d in deltas["json"])
    assert re.fullmatch("(ab|cd){2,5}", text), text
    time.sleep(0.2)
    s = stats(conn)
    assert s.num_requests_running == s.num_requests_waiting == 0
    assert s.num_free_kv_blocks == s.num_kv_blocks
