"""ReplicaSet's placement without engine processes: prefix affinity, the overload escape,
turns among idle replicas, dead replicas skipped, and the load it counts."""

import asyncio

import pytest

from nanovllm.engine.messages import AddRequest, EngineInfo
from nanovllm.entrypoints.openai import replicas
from nanovllm.entrypoints.openai.engine_client import EngineDeadError
from nanovllm.entrypoints.openai.replicas import AFFINITY_SLACK, ReplicaSet

BS = 4


class FakeClient:
    def __init__(self) -> None:
        self.info = EngineInfo(max_model_len=64, vocab_size=100, num_kv_blocks=8,
                               block_size=BS, eos_token_ids=(2,), pid=0, max_num_seqs=4)
        self.alive, self.error = True, None
        self.added, self.released = [], []

    async def add(self, req, out) -> None:
        self.added.append(req.request_id)

    def release(self, request_id: str, abort: bool) -> None:
        self.released.append((request_id, abort))


def replica_set(n: int = 2) -> ReplicaSet:
    return ReplicaSet([FakeClient() for _ in range(n)])


DOC = list(range(10, 10 + 8 * BS))


def test_a_prefix_goes_home_unless_home_is_busier_than_the_slack():
    rs = replica_set()
    home = rs.place(DOC + [1])
    assert all(rs.place(DOC + [k]) == home for k in range(5))
    assert rs.place(DOC[: 3 * BS] + [7]) == home  # a shorter shared prefix still matches
    rs.load[home] = AFFINITY_SLACK  # exactly the slack beyond the idle one: still home
    assert rs.place(DOC + [9]) == home
    rs.load[home] = AFFINITY_SLACK + 1  # beyond it: the least loaded takes it, and keeps it
    other = rs.place(DOC + [9])
    assert other != home
    rs.load[home] = 0
    assert rs.place(DOC + [3]) == other


def test_unrelated_prompts_take_turns_and_the_least_loaded_wins():
    rs = replica_set(3)
    picks = [rs.place([i] * BS * 2) for i in range(6)]
    assert sorted(picks[:3]) == [0, 1, 2] and picks[3:] == picks[:3]
    rs.load = [3, 1, 2]
    assert rs.place([99] * BS * 2) == 1
    assert rs.place([5]) == 1  # shorter than a block: no prefix to remember


def test_dead_replicas_are_skipped_and_all_dead_is_an_error():
    rs = replica_set()
    home = rs.place(DOC)
    rs.clients[home].alive = False
    assert rs.place(DOC) == 1 - home
    assert rs.down() == {home: "the engine process has exited"}
    rs.clients[1 - home].alive = False
    with pytest.raises(EngineDeadError):
        rs.place(DOC)


def test_load_counts_requests_from_add_to_release():
    rs = replica_set()

    async def go():
        q = asyncio.Queue()
        req = AddRequest("a", DOC, None)
        await rs.add(req, q)
        i = rs._owner["a"]
        assert rs.load[i] == 1 and rs.clients[i].added == ["a"]
        rs.release("a", abort=True)
        assert rs.load == [0, 0] and rs.clients[i].released == [("a", True)]
        rs.release("a", abort=True)  # twice: nothing more
        assert rs.load == [0, 0] and len(rs.clients[i].released) == 1

    asyncio.run(go())


def test_the_affinity_map_forgets_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(replicas, "AFFINITY_ENTRIES", 4)
    rs = replica_set()
    rs.place(DOC)  # 8 blocks: only the last 4 hashes stay
    assert len(rs._affinity) == 4
