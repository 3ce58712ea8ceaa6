"""KV cache events on ZMQ, read by a real subscriber and decoded with msgspec structs of
vLLM's event format (array-like tagged structs, as KV-aware routers decode them): replaying
them gives exactly the hashes each tier holds, chained as the prefix cache chains them."""

import random
import time
from typing import Any

import msgspec
import pytest
import zmq

from nanovllm import LLM, SamplingParams
from nanovllm.core.block_manager import hash_block
from nanovllm.core.errors import ConfigError

BS = 4


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def subscribe(endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
    return sub


def receive(sub: zmq.Socket) -> list[tuple[bytes, int, KVEventBatch]]:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    got = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        got.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
    return got


def replay(batches) -> dict[str, set[int]]:
    held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for _, _, batch in batches:
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert e.block_size == BS and len(e.token_ids) == BS * len(e.block_hashes)
                assert not held[e.medium] & set(e.block_hashes), "stored twice"
                held[e.medium] |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= held[e.medium], "removed what was not stored"
                held[e.medium] -= set(e.block_hashes)
            else:
                held = {"GPU": set(), "CPU": set()}
    return held


def test_events_replay_to_the_hashes_each_tier_holds(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=16, block_size=BS,
              cpu_offload_gib=0.01, kv_events_endpoint="tcp://127.0.0.1:*",
              kv_events_topic="kv")
    engine = llm.engine
    sub = subscribe(engine.kv_events.endpoint, b"kv")
    rng = random.Random(0)
    first = [rng.randrange(3, 400) for _ in range(17)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([first], params, use_tqdm=False)
    batches = receive(sub)
    assert [seq for _, seq, _ in batches] == list(range(len(batches)))
    assert {topic for topic, _, _ in batches} == {b"kv"}
    # the first prompt's full blocks, in order, each chained to the one before it
    stored = [e for _, _, b in batches for e in b.events if isinstance(e, BlockStored)]
    parent = None
    for i, e in enumerate(stored[:4]):
        tokens = first[i * BS : (i + 1) * BS]
        expected = hash_block(tokens, parent or 0)
        assert (e.block_hashes, e.parent_block_hash, e.token_ids, e.medium) == (
            [expected], parent, tokens, "GPU")
        parent = expected

    others = [[rng.randrange(3, 400) for _ in range(30)] for _ in range(2)]
    llm.generate(others, params, use_tqdm=False)  # pushes the first prompt out to the host
    batches += receive(sub)
    bm = engine.block_manager
    held = replay(batches)
    assert held["GPU"] == set(bm.hash_to_block) and held["CPU"] == set(bm.host.hash_to_block)
    assert held["CPU"] and any(isinstance(e, BlockRemoved) for _, _, b in batches
                               for e in b.events)

    assert bm.reset_prefix_cache()
    llm.generate([[5, 6]], params, use_tqdm=False)
    tail = receive(sub)
    assert isinstance(tail[0][2].events[0], AllBlocksCleared)
    assert replay(batches + tail)["GPU"] == set(bm.hash_to_block)
    sub.close(linger=0)
    engine.kv_events.close()


def test_an_address_in_use_is_a_clear_error(tiny_llama):
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match="kv_events_endpoint.*cannot bind"):
            LLM(str(tiny_llama), device="cpu", num_kv_blocks=16,
                kv_events_endpoint=f"tcp://127.0.0.1:{port}")
    finally:
        pub.close(linger=0)
