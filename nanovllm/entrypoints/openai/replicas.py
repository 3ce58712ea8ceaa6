"""Data parallelism in one server (`--data-parallel-size N`): N engine processes, each a
whole engine on its own GPU (or a share of the CPU's cores), behind one front end.

`ReplicaSet` has the interface the routes use (`add`, `release`, `stats`, `alive`, `info`,
`attach`, `shutdown`, `on_death`), so one engine is a set of one. Each request goes to one
replica:
- by load: every engine reports its waiting and running requests and free KV blocks
  (messages.Load, after its steps, ~100 times a second while it works, and when it goes
  idle) to every front end. A replica's load is its running requests plus WAITING_WEIGHT
  per waiting one, the requests this front end sent since the report counted as waiting,
  and the new request too where its prompt would not fit in the free KV blocks (it would
  wait there). So the front ends of `--api-server-count` see each other's requests, and
  a replica whose cache is full of long contexts looks as busy as it is;
- prefix affinity: the chained hashes of the prompt's leading blocks (the prefix cache's
  key, core/block_manager.py) remember which replica last took them; the replica that holds
  the longest known prefix gets the request,
- unless it is overloaded: a load above the least loaded live replica's plus
  AFFINITY_SLACK; then the least loaded takes it (and the prefix is remembered there); a
  prompt with no remembered prefix goes to the least loaded, ties taking turns.
A replica whose process dies is taken out of placement (its requests in flight end with an
error), `/health` names it and stays 200 while another serves; when the last one dies the
server exits, as with one engine.
"""

import asyncio
import dataclasses
import logging
import os
from collections import OrderedDict

from nanovllm.core.block_manager import hash_block
from nanovllm.core.errors import ConfigError
from nanovllm.engine.messages import AddRequest, EngineProcessConfig, EngineStats
from nanovllm.entrypoints.openai.engine_client import EngineClient, EngineDeadError

log = logging.getLogger("nanovllm.server")

WAITING_WEIGHT = 4  # a waiting request loads a replica as much as this many running ones
# the load a prefix's replica may have beyond the least loaded one's: two more requests
# waiting, or eight more running
AFFINITY_SLACK = 2 * WAITING_WEIGHT
AFFINITY_BLOCKS = 64  # leading blocks of a prompt remembered per placement
AFFINITY_ENTRIES = 200_000  # prefix hashes remembered in all (least recently used go)


class ReplicaSet:
    def __init__(self, clients: list[EngineClient]) -> None:
        self.clients = clients
        self.info = clients[0].info
        self.block_size = self.info.block_size
        self._owner: dict[str, int] = {}  # request id -> replica
        self._affinity: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica
        self._turn = 0
        self.on_death = None  # called once the last replica is gone (front_ends.py)

    @classmethod
    def start(cls, config: EngineProcessConfig, size: int = 1,
              num_front_ends: int = 1) -> "ReplicaSet":
        """Spawn `size` engine processes, on a GPU machine tensor_parallel_size GPUs each
        (CUDA_VISIBLE_DEVICES), else an equal share of the CPU's threads; block until all
        are ready. Each gets a pipe per front-end process (`front_end_pipes`)."""
        if size == 1:
            return cls([EngineClient.start(config, num_front_ends)])
        import torch  # only here: one engine needs no torch in the front end

        clients: list[EngineClient] = []
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = env.split(",") if env else [str(i) for i in range(torch.cuda.device_count())]
        engine = config.engine
        tp = engine.tensor_parallel_size
        on_gpu = engine.device == "cuda" or (engine.device == "auto" and gpus)
        if on_gpu and len(gpus) < size * tp:
            raise ConfigError(f"--data-parallel-size {size} x --tensor-parallel-size {tp} "
                              f"needs {size * tp} GPUs; {len(gpus)} are visible")
        if not on_gpu and engine.num_threads is None:
            threads = max(1, (os.cpu_count() or 1) // (size * tp))
            config = dataclasses.replace(config, engine=dataclasses.replace(
                engine, num_threads=threads))
        try:
            for i in range(size):
                if on_gpu:  # the child reads its environment when it starts
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * tp : (i + 1) * tp])
                own = config
                if config.engine.kv_events_endpoint:  # one socket each: port + replica
                    own = dataclasses.replace(config, engine=dataclasses.replace(
                        config.engine,
                        kv_events_endpoint=offset_port(config.engine.kv_events_endpoint, i)))
                clients.append(EngineClient.start(own, num_front_ends))
        except BaseException:
            for c in clients:
                c.shutdown()
            raise
        finally:
            if on_gpu:
                if env is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = env
        return cls(clients)

    @classmethod
    def connect(cls, pipes: list[tuple]) -> "ReplicaSet":
        """In another front-end process: the replicas the first one started, from their
        (pipe, pid) pairs (`front_end_pipes`)."""
        return cls([EngineClient.connect(conn, pid) for conn, pid in pipes])

    def front_end_pipes(self, k: int) -> list[tuple]:
        """Front-end process k's (pipe, engine pid) for each replica (k >= 1)."""
        return [(c.spare_conns[k - 1], c.info.pid) for c in self.clients]

    def close_spare_pipes(self) -> None:
        """This process's copies of the other front ends' pipes: closed once those have
        theirs, so an engine sees the end of a pipe when its front end goes."""
        for c in self.clients:
            for conn in c.spare_conns:
                conn.close()
            c.spare_conns = []

    # ---- what the routes use ------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return any(c.alive for c in self.clients)

    @property
    def error(self) -> str | None:
        return None if self.alive else self.clients[0].error

    def down(self) -> dict[int, str]:
        """The replicas that are gone, and why."""
        return {i: c.error or "the engine process has exited"
                for i, c in enumerate(self.clients) if not c.alive}

    def attach(self) -> None:
        for i, c in enumerate(self.clients):
            c.on_death = lambda reason, i=i: self._replica_died(i, reason)
            c.attach()

    async def add(self, req: AddRequest, out: asyncio.Queue) -> None:
        i = self.place(req.prompt_token_ids)
        self._owner[req.request_id] = i
        try:
            await self.clients[i].add(req, out)
        except BaseException:
            self._owner.pop(req.request_id, None)
            raise

    def release(self, request_id: str, abort: bool) -> None:
        i = self._owner.pop(request_id, None)
        if i is not None:
            self.clients[i].release(request_id, abort)

    async def stats(self, timeout: float = 5.0) -> list[tuple[int, EngineStats]]:
        """Each live replica's snapshot, by replica index."""
        live = [i for i, c in enumerate(self.clients) if c.alive]
        got = await asyncio.gather(*(self.clients[i].stats(timeout) for i in live),
                                   return_exceptions=True)
        snaps = [(i, s) for i, s in zip(live, got) if isinstance(s, EngineStats)]
        if not snaps:
            raise EngineDeadError(self.error or "no engine replica answered")
        return snaps

    def shutdown(self, timeout: float = 10.0) -> None:
        for c in self.clients:
            c.shutdown(timeout)

    # ---- placement ------------------------------------------------------------------------

    def place(self, prompt: list[int]) -> int:
        """The replica for a prompt (see the module docstring)."""
        live = [i for i, c in enumerate(self.clients) if c.alive]
        if not live:
            raise EngineDeadError(self.error or "every engine replica has exited")
        if len(self.clients) == 1:
            return live[0]
        bs = self.block_size
        load = {i: self.load_of(i, -(-len(prompt) // bs)) for i in live}
        fewest = min(load.values())
        idle = [i for i in live if load[i] == fewest]
        self._turn += 1
        least = idle[self._turn % len(idle)]  # ties take turns
        hashes, h = [], 0
        for start in range(0, min(len(prompt) // bs, AFFINITY_BLOCKS) * bs, bs):
            h = hash_block(prompt[start : start + bs], h)
            hashes.append(h)
        home = None
        for h in reversed(hashes):  # the longest remembered prefix
            i = self._affinity.get(h)
            if i is not None and self.clients[i].alive:
                home = i
                break
        chosen = home if home is not None and (
            load[home] <= load[least] + AFFINITY_SLACK) else least
        for h in hashes:
            self._affinity[h] = chosen
            self._affinity.move_to_end(h)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return chosen

    def load_of(self, i: int, prompt_blocks: int) -> int:
        """Replica i's load for a prompt of `prompt_blocks` KV blocks (module docstring)."""
        c = self.clients[i]
        r = c.load
        if r is None:  # the engine has not stepped yet: whatever was sent waits
            waiting, running, free, seen = 0, 0, c.info.num_kv_blocks, 0
        else:
            waiting, running = r.num_waiting, r.num_running
            free, seen = r.num_free_kv_blocks, r.adds_seen
        waiting += c.sent_adds - seen
        if prompt_blocks > free:
            waiting += 1
        return running + WAITING_WEIGHT * waiting

    def _replica_died(self, i: int, reason: str) -> None:
        if len(self.clients) > 1:
            log.error("engine replica %d is gone (%s); %d of %d still serve", i, reason,
                      sum(c.alive for c in self.clients), len(self.clients))
        if not self.alive and self.on_death is not None:
            self.on_death(reason)


def offset_port(endpoint: str, i: int) -> str:
    """Replica i's KV-event address: a tcp port + i, as vLLM offsets its data-parallel
    ranks' ("tcp://*:5557" -> "tcp://*:5558" for replica 1); other transports get a suffix."""
    if i == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + i}"
    return f"{endpoint}_dp{i}"
