"""KV cache events over ZMQ in vLLM's format, for KV-aware routers (llm-d, Dynamo, Ray
Serve's): which block hashes each tier of this engine holds, as they come and go.

`kv_events_endpoint="tcp://*:5557"` (`--kv-events-endpoint`): after each step that changed
the cache, one message on a ZMQ PUB socket bound there, in three frames as vLLM sends them:
the topic (`kv_events_topic`, default empty), an 8-byte big-endian sequence number, and a
msgpack payload: the batch `[timestamp, [event, ...]]`, each event an array led by its type
(msgspec's array-like tagged structs, as vLLM's `KVEventBatch` encodes them):

    ["BlockStored", [block_hash], parent_block_hash | None, [token ids], block_size,
     lora_id (None), medium ("GPU" | "CPU")]
    ["BlockRemoved", [block_hash], medium]
    ["AllBlocksCleared"]

A block hash is the chained xxh64 of its tokens and every block before it (the prefix
cache's key, core/block_manager.py), an unsigned 64-bit integer; "GPU" is the device cache
(whatever the device), "CPU" the host tier. The socket never blocks the engine: past its
high-water mark ZMQ drops messages, and the sequence numbers show the gap.
"""

import time

import msgpack
import zmq

from nanovllm.core.errors import ConfigError

HIGH_WATER_MARK = 100_000


class KVEventPublisher:
    def __init__(self, endpoint: str, block_size: int, topic: str = "") -> None:
        self.block_size = block_size
        self.topic = topic.encode()
        self.seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(HIGH_WATER_MARK)
        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            raise ConfigError(
                f"kv_events_endpoint={endpoint!r}: cannot bind ({e}); use a free address such "
                "as 'tcp://*:5557'"
            ) from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: list[tuple]) -> None:
        """One batch of BlockManager.cache_events; nothing is sent for none."""
        if not events:
            return
        batch = [time.time(), [self._encode(e) for e in events]]
        payload = msgpack.packb(batch)
        try:
            self._pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a subscriber fell behind: it sees the gap in the sequence numbers
        self.seq += 1

    def _encode(self, event: tuple) -> list:
        match event:
            case ("stored", medium, h, parent, tokens):
                return ["BlockStored", [h], parent, list(tokens), self.block_size, None, medium]
            case ("removed", medium, h):
                return ["BlockRemoved", [h], medium]
            case ("cleared",):
                return ["AllBlocksCleared"]
        raise ValueError(f"unknown cache event {event!r}")

    def close(self) -> None:
        self._pub.close(linger=0)
