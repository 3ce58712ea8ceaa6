"""One rank's model, KV cache and step buffers: a scheduled batch in, one forward pass and
one sampled token per finishing row out.

The runner is the per-rank unit: it owns everything that lives on its device and knows
nothing of requests or scheduling. Its life: built (the model loaded with the engine's
kernels), asked how many KV blocks fit (`measure_kv_blocks`), `setup` with the final config
(cache, buffers, warm-up, CUDA graphs), then `launch` / `collect` once per step.
"""

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.core.config import ResolvedConfig
from nanovllm.core.host_tier import PreemptionCost
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.kernels import select_kernels
from nanovllm.model.config import ModelConfig
from nanovllm.model.layers.sampler import SamplerOutput
from nanovllm.model.loader.source import ModelSource
from nanovllm.model.loader.weights import load_weights
from nanovllm.model.models.registry import build_model
from nanovllm.model.parallel import SINGLE, TensorParallel
from nanovllm.worker.cpu_threads import CpuThreads
from nanovllm.worker.host_pool import HostKVPool, measure_preemption_cost, plan_num_host_blocks
from nanovllm.worker.inputs import InputBuffers, StepInputs
from nanovllm.worker.kv_cache import KVCache, KVFormat, plan_num_blocks
from nanovllm.worker.sampling import StepSampler, logprob_dicts
from nanovllm.worker.warmup import profile_activation_bytes, warm_up_kernels

log = logging.getLogger("nanovllm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepOutput:
    """One sampled token per sampling row, and its logprobs when asked for."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None  # None when no row asked for them


@dataclass
class StepHandle:
    """A launched step whose sampled tokens may still be on the device."""

    seqs: list[Sequence]  # the sampling rows, in order
    rows: dict[int, int]  # seq id -> row, for the next step's placeholder tokens
    out: SamplerOutput | None
    host_tokens: torch.Tensor | None  # pinned copy of out.token_ids
    event: torch.cuda.Event | None


class ModelRunner:
    """`launch` queues a step on the device and returns at once on a GPU; `collect` waits
    for its sampled tokens. Between the two the engine can schedule the next step.

    Under tensor parallelism (`tp`) the runner holds its rank's shard of the model and of
    the KV cache. Rank 0's runner drives the others through `peers` (worker/
    tensor_parallel.py): every start-up call and every step's inputs go to them first; the
    other ranks' runners only `run_step`.
    """

    def __init__(
        self, config: ResolvedConfig, source: ModelSource, model_config: ModelConfig,
        eos_token_ids: set[int], tp: TensorParallel = SINGLE, peers=None,
    ) -> None:
        self.config = config
        self.tp, self.peers = tp, peers
        # the KV cache and the cost model see this rank's heads
        _, heads = tp.split(model_config.num_attention_heads, "attention heads")
        _, kv_heads = tp.kv_heads(model_config.num_key_value_heads)
        self.model_config = dataclasses.replace(
            model_config, num_attention_heads=heads, num_key_value_heads=kv_heads)
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.kv_format = KVFormat.of(config.kv_cache_dtype, self.dtype, model_config.head_dim)
        # on a CPU without num_threads: as many threads as other processes leave cores
        self.cpu_threads = None
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        elif self.device.type == "cpu":
            self.cpu_threads = CpuThreads.create()
        torch.manual_seed(config.seed)
        self.kernels = select_kernels(config.kernels, config.attention_backend, config.split_k,
                                      fresh_prefill=config.kv_cache_dtype == "fp8")
        start = time.perf_counter()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(
                    model_config, model_config.max_position_embeddings, self.kernels, tp
                )
        finally:
            torch.set_default_dtype(prev)
        quantized = config.weight_format != "dense"
        forms = load_weights(self.model, source.tensors(quantized=quantized),
                             config.weight_format)
        self.model.eval()
        shard = f", rank {tp.rank} of {tp.size}" if tp.size > 1 else ""
        log.info("loaded %s in %.1f s (%s on %s%s; weights: %s)", source.path.name,
                 time.perf_counter() - start, config.dtype, self.device, shard,
                 ", ".join(f"{n} {form}" for form, n in sorted(forms.items())))
        self.sampler = StepSampler(
            self.kernels, eos_token_ids, model_config.vocab_size, self.device
        )
        self.kv_cache: KVCache | None = None
        self.host_pool: HostKVPool | None = None
        self.preemption_cost: PreemptionCost | None = None
        self.buffers: InputBuffers | None = None
        self.graphs = None
        self._token_ring: list[torch.Tensor] = []  # pinned homes of sampled tokens (CUDA)
        self._event_ring: list[torch.cuda.Event] = []
        self._ring_turn = 0

    # ---- start-up -------------------------------------------------------------------

    def measure_kv_blocks(self) -> int:
        """How many KV blocks fit on this rank (see kv_cache.plan_num_blocks); on rank 0 of
        a tensor-parallel group, the fewest that fit on any rank."""
        if self.peers is None:
            return self._measure_kv_blocks()
        from nanovllm.worker.messages import MeasureKVBlocks

        self.peers.control(MeasureKVBlocks())
        from nanovllm.worker.tp_group import smallest

        return self._in_step(lambda: smallest(self._measure_kv_blocks()))

    def _measure_kv_blocks(self) -> int:
        return plan_num_blocks(self.config, self.model_config, self.kv_format, self.device,
                               lambda: profile_activation_bytes(self))

    def measure_host_blocks(self) -> int:
        """How many blocks the host tier holds (swap_space + cpu_offload_gib)."""
        return plan_num_host_blocks(self.config, self.model_config, self.kv_format)

    @torch.inference_mode()
    def setup(self, config: ResolvedConfig) -> None:
        """Allocate the KV cache and the step buffers for the final `config`; on CUDA warm
        the kernels up and capture CUDA graphs."""
        if self.peers is not None:
            from nanovllm.worker.messages import Setup

            self.peers.control(Setup(config))
            return self._in_step(lambda: self._setup(config))
        return self._setup(config)

    def _setup(self, config: ResolvedConfig) -> None:
        self.config = cfg = config
        self.kv_cache = KVCache(self.model_config, cfg.num_kv_blocks, cfg.block_size,
                                self.kv_format, self.device)
        self.kv_cache.bind(self.model)
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%s)",
                 cfg.num_kv_blocks, cfg.block_size, cfg.kv_cache_tokens, self.kv_cache.gib,
                 cfg.dtype if cfg.kv_cache_dtype == "auto"
                 else f"{cfg.kv_cache_dtype}, a scale per token and head")
        if cfg.num_host_blocks:
            self.host_pool = HostKVPool(self.kv_cache, cfg.num_host_blocks)
            log.info("host KV tier: %d blocks, %.2f GiB (swap %g GiB, prefix offload %g GiB)",
                     cfg.num_host_blocks, self.host_pool.gib, cfg.swap_space,
                     cfg.cpu_offload_gib)
            if cfg.swap_space and cfg.preemption_mode == "auto" and self.tp.rank == 0:
                cost = measure_preemption_cost(self.kv_cache, self.model_config,
                                               cfg.max_num_batched_tokens, self.dtype)
                self.preemption_cost = cost
                log.info("preemption cost: copies %.1f GB/s, matmuls %.1f TFLOP/s: a block "
                         "of %d tokens swaps in %.3f ms, recomputes in %.3f ms",
                         cost.copy_bytes_per_s / 1e9, cost.flops_per_s / 1e12, cfg.block_size,
                         cost.swap_seconds(1) * 1e3,
                         cost.recompute_seconds(cfg.block_size) * 1e3)
        self.buffers = InputBuffers(
            max(cfg.max_num_batched_tokens, cfg.max_num_seqs), cfg.max_num_seqs,
            -(-cfg.max_model_len // cfg.block_size), cfg.block_size, self.device,
        )
        if self.device.type != "cuda":
            return
        # at most two steps are ever in flight: three pinned homes for their tokens
        self._token_ring = [
            torch.empty(cfg.max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(3)
        ]
        self._event_ring = [torch.cuda.Event() for _ in range(3)]
        start = time.perf_counter()
        warm_up_kernels(self)
        log.info("kernels warmed up in %.1f s", time.perf_counter() - start)
        if cfg.cuda_graphs:
            from nanovllm.worker.cuda_graph import DecodeGraphs

            start = time.perf_counter()
            self.graphs = DecodeGraphs(self.model, self.buffers, cfg.max_num_seqs,
                                       cfg.max_model_len)
            self.graphs.capture()
            log.info("captured CUDA graphs for decode batch sizes %s in %.1f s",
                     self.graphs.sizes, time.perf_counter() - start)

    # ---- one step -------------------------------------------------------------------

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, prev: StepHandle | None = None,
        before_sampling: Callable[[], np.ndarray | None] | None = None,
    ) -> StepHandle:
        """Queue one forward pass and sampling; tokens of `prev` still on the device are
        read there (CPU/GPU overlap). The batch's KV copies run first. `before_sampling`
        runs on the host once the forward pass is queued, while the device computes it; it
        returns the rows' structured-output bitmask (or None) that sampling applies."""
        if self.peers is None:
            return self._launch(batch, prev, before_sampling)
        return self._in_step(lambda: self._launch(batch, prev, before_sampling))

    def _in_step(self, fn):
        """Rank 0's side of a call every rank makes together (a step, start-up's sizing and
        setup): a rank that died, or this rank failing half-way, leaves the group out of
        step (Peers.step_failed)."""
        try:
            with self.peers.busy_section():
                return fn()
        except BaseException as e:
            failure = self.peers.step_failed(e)
            if failure is e:
                raise
            raise failure from e

    def _launch(self, batch: ScheduledBatch, prev: StepHandle | None,
                before_sampling: Callable[[], np.ndarray | None] | None) -> StepHandle:
        if self.cpu_threads is not None:
            self.cpu_threads.update()
        seqs = batch.sampling_seqs
        pad = 0
        decode = batch.num_tokens == len(batch.seqs)  # every row schedules at least one token
        if decode and self.graphs is not None:
            pad = self.graphs.padded_size(len(batch.seqs)) or 0
        temps = self.sampler.one_pass_temperatures(seqs)
        inputs = self.buffers.prepare(batch, pad, prev.rows if prev is not None else None, temps)
        self._fill_placeholders(inputs, prev)
        if self.peers is not None:
            self.peers.send_step(inputs, self.buffers, batch.copies_out, batch.copies_in)
        self._copy_blocks(batch.copies_out, batch.copies_in)
        logits = self.logits(inputs)
        bitmask = before_sampling() if before_sampling is not None else None
        if not seqs:
            return StepHandle([], {}, None, None, None)
        return self._handle(seqs, self.sampler.sample(logits, seqs, inputs.temperatures,
                                                      bitmask))

    @torch.inference_mode()
    def run_step(self, inputs: StepInputs | None, copies_out, copies_in) -> None:
        """A tensor-parallel rank other than 0: rank 0's step, on this rank's shard (its
        logits are gathered on every rank; rank 0 samples). None: the copies alone."""
        self._copy_blocks(copies_out, copies_in)
        if inputs is not None:
            self.logits(inputs)

    @torch.inference_mode()
    def copy_blocks(self, batch: ScheduledBatch) -> None:
        """The batch's copies between the KV cache and the host tier (HostKVPool.copy),
        for a batch that runs no forward pass."""
        if not batch.has_copies:
            return
        if self.peers is None:
            return self._copy_blocks(batch.copies_out, batch.copies_in)
        def copies() -> None:
            self.peers.send_copies(batch.copies_out, batch.copies_in)
            self._copy_blocks(batch.copies_out, batch.copies_in)

        self._in_step(copies)

    def _copy_blocks(self, copies_out, copies_in) -> None:
        if copies_out or copies_in:
            self.host_pool.copy(copies_out, copies_in)

    def logits(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass of prepared inputs: logits of the sampling rows."""
        graphs = self.graphs
        if graphs is not None and inputs.decode_only and inputs.padded_rows in graphs.graphs:
            return graphs.replay(inputs.padded_rows, inputs.num_sampling_rows)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.num_sampling_rows == 0:
            return hidden[:0]
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    def _fill_placeholders(self, inputs: StepInputs, prev: StepHandle | None) -> None:
        if not inputs.placeholder_seq_ids:
            return
        assert prev is not None and prev.out is not None, "a placeholder with no step in flight"
        tokens = prev.out.token_ids.index_select(0, inputs.placeholder_rows)
        inputs.input_ids.index_copy_(0, inputs.placeholder_positions, tokens)

    def _handle(self, seqs: list[Sequence], out: SamplerOutput) -> StepHandle:
        rows = {s.seq_id: i for i, s in enumerate(seqs)}
        if self.device.type != "cuda":
            return StepHandle(seqs, rows, out, out.token_ids, None)
        k = self._ring_turn
        self._ring_turn = (k + 1) % len(self._token_ring)
        host = self._token_ring[k][: len(seqs)]
        host.copy_(out.token_ids, non_blocking=True)
        event = self._event_ring[k]
        event.record()
        return StepHandle(seqs, rows, out, host, event)

    def collect(self, handle: StepHandle) -> StepOutput:
        """Wait for a launched step's tokens (and logprobs) and bring them to the host."""
        if handle.out is None:
            return StepOutput([], None)
        if handle.event is not None:
            if self.peers is not None:
                with self.peers.busy_section():
                    handle.event.synchronize()
            else:
                handle.event.synchronize()
        token_ids = handle.host_tokens.tolist()
        return StepOutput(token_ids, logprob_dicts(handle.out, handle.seqs, token_ids))

    def shutdown(self) -> None:
        """Rank 0 of a tensor-parallel group: stop the other ranks and leave the group."""
        if self.peers is not None:
            self.release_graphs()
            self.peers.shutdown()

    def release_graphs(self) -> None:
        """Drop the CUDA graphs (under tensor parallelism they hold NCCL work) before the
        process group goes; the runner runs eagerly after this."""
        if self.graphs is not None:
            self.graphs = None
            torch.cuda.synchronize()
