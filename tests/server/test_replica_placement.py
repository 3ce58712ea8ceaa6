"""ReplicaSet's placement without engine processes: load from the engines' reports, prefix
affinity, the overload escape, turns among idle replicas, dead replicas skipped."""

import asyncio

import pytest

from nanovllm.engine.messages import AddRequest, EngineInfo, Load
from nanovllm.entrypoints.openai import replicas
from nanovllm.entrypoints.openai.engine_client import EngineDeadError
from nanovllm.entrypoints.openai.replicas import AFFINITY_SLACK, WAITING_WEIGHT, ReplicaSet

BS = 4
BLOCKS = 64


class FakeClient:
    """An EngineClient's placement view: its engine's last Load and the adds sent."""

    def __init__(self) -> None:
        self.info = EngineInfo(max_model_len=64, vocab_size=100, num_kv_blocks=BLOCKS,
                               block_size=BS, eos_token_ids=(2,), pid=0, max_num_seqs=4)
        self.alive, self.error = True, None
        self.added, self.released = [], []
        self.load: Load | None = None
        self.sent_adds = 0

    async def add(self, req, out) -> None:
        self.sent_adds += 1
        self.added.append(req.request_id)

    def release(self, request_id: str, abort: bool) -> None:
        self.released.append((request_id, abort))

    def report(self, waiting=0, running=0, free=BLOCKS) -> None:
        """The engine's Load, having taken every add sent so far."""
        self.load = Load(waiting, running, free, self.sent_adds)


def replica_set(n: int = 2) -> ReplicaSet:
    return ReplicaSet([FakeClient() for _ in range(n)])


DOC = list(range(10, 10 + 8 * BS))


def test_a_prefix_goes_home_unless_home_is_busier_than_the_slack():
    rs = replica_set()
    home = rs.place(DOC + [1])
    assert all(rs.place(DOC + [k]) == home for k in range(5))
    assert rs.place(DOC[: 3 * BS] + [7]) == home  # a shorter shared prefix still matches
    rs.clients[home].report(running=AFFINITY_SLACK)  # exactly the slack: still home
    assert rs.place(DOC + [9]) == home
    rs.clients[home].report(running=AFFINITY_SLACK + 1)  # beyond it: the least loaded takes
    other = rs.place(DOC + [9])  # it, and keeps it
    assert other != home
    rs.clients[home].report()
    assert rs.place(DOC + [3]) == other


def test_unrelated_prompts_take_turns_and_the_least_loaded_wins():
    rs = replica_set(3)
    picks = [rs.place([i] * BS * 2) for i in range(6)]
    assert sorted(picks[:3]) == [0, 1, 2] and picks[3:] == picks[:3]
    two = replica_set(2)
    picks = [two.place([i] * BS * 2) for i in range(4)]
    assert picks[0] != picks[1] and picks[:2] == picks[2:]  # each in turn, not one twice
    for c, running in zip(rs.clients, [3, 1, 2]):
        c.report(running=running)
    assert rs.place([99] * BS * 2) == 1
    assert rs.place([5]) == 1  # shorter than a block: no prefix to remember, so
    rs.clients[1].report(running=3)  # once replica 1 is busier, it does not follow it
    assert rs.place([5]) == 2
    # a waiting request weighs WAITING_WEIGHT (4) running ones: loads 3, 4 and 2
    rs.clients[1].report(waiting=1, running=0)
    assert rs.place([98] * BS * 2) == 2


def test_requests_sent_since_the_last_report_count_as_waiting():
    """What this front end sent after the engine's last Load is not in it yet: it counts as
    waiting, until a Load says the engine has taken it."""
    rs = replica_set()
    q = asyncio.Queue()

    async def add(rid: str, prompt: list[int]) -> int:
        await rs.add(AddRequest(rid, prompt, None), q)
        return rs._owner[rid]

    async def go():
        first = await add("a", [1] * BS)
        assert rs.load_of(first, 1) == WAITING_WEIGHT and rs.load_of(1 - first, 1) == 0
        assert await add("b", [2] * BS) == 1 - first  # the other, though both reported 0
        rs.clients[first].report(running=1)  # the engine took "a" and runs it
        assert rs.load_of(first, 1) == 1

    asyncio.run(go())


def test_a_prompt_that_does_not_fit_in_the_free_blocks_counts_as_waiting():
    rs = replica_set()
    rs.clients[0].report(running=1, free=2)  # a cache nearly full of long contexts
    rs.clients[1].report(running=3, free=BLOCKS)
    assert rs.place([7] * (2 * BS)) == 0  # 2 blocks fit: 1 running is the lighter load
    assert rs.place([8] * (3 * BS)) == 1  # 3 do not: it would wait behind the running ones
    assert rs.load_of(0, 3) == 1 + WAITING_WEIGHT
    rs.clients[0].report(waiting=2, running=1, free=2)  # one more behind those waiting
    assert rs.load_of(0, 3) == 1 + 3 * WAITING_WEIGHT and rs.load_of(0, 2) == 1 + 8


def test_dead_replicas_are_skipped_and_all_dead_is_an_error():
    rs = replica_set()
    home = rs.place(DOC)
    rs.clients[home].alive = False
    assert rs.place(DOC) == 1 - home
    assert rs.down() == {home: "the engine process has exited"}
    rs.clients[1 - home].alive = False
    with pytest.raises(EngineDeadError):
        rs.place(DOC)


def test_release_goes_to_the_replica_that_took_the_request_once():
    rs = replica_set()

    async def go():
        q = asyncio.Queue()
        await rs.add(AddRequest("a", DOC, None), q)
        i = rs._owner["a"]
        assert rs.clients[i].added == ["a"]
        rs.release("a", abort=True)
        assert rs.clients[i].released == [("a", True)] and "a" not in rs._owner
        rs.release("a", abort=True)  # twice: nothing more
        assert len(rs.clients[i].released) == 1

    asyncio.run(go())


def test_the_affinity_map_forgets_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(replicas, "AFFINITY_ENTRIES", 4)
    rs = replica_set()
    rs.place(DOC)  # 8 blocks: only the last 4 hashes, the longest prefixes, stay
    hashes, h = [], 0
    for start in range(0, len(DOC), BS):
        h = replicas.hash_block(DOC[start : start + BS], h)
        hashes.append(h)
    assert list(rs._affinity) == hashes[4:]
