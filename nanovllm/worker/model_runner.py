import logging
import mmap
from dataclasses import dataclass

import torch

from nanovllm.core.config import EngineConfig
from nanovllm.core.errors import ConfigError
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.model.config import ModelConfig
from nanovllm.model.layers import compile as compile_layers
from nanovllm.model.layers.sampler import (
    MIN_TEMPERATURE,
    SamplerOutput,
    sample,
)
from nanovllm.model.loader.source import ModelSource
from nanovllm.model.loader.weights import load_weights
from nanovllm.model.models.registry import build_model
from nanovllm.worker.inputs import InputBuffers, StepInputs, prepare_inputs
from nanovllm.worker.sampling_metadata import build_sampling_tensors

log = logging.getLogger("nanovllm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_GIB = 2.0


@dataclass
class StepOutput:
    """One sampled token per sampling row, and its logprobs when asked for."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


@dataclass
class StepHandle:
    """A launched step whose sampled tokens may still be on the device."""

    seqs: list[Sequence]  # the sampling rows, in order
    rows: dict[int, int]  # seq id -> row, for the next step's placeholder tokens
    out: SamplerOutput | None
    host_tokens: torch.Tensor | None  # pinned copy of out.token_ids
    event: torch.cuda.Event | None
    want_logprobs: bool


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA GPU is visible; use device='cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPUs are fastest and exact in float32; GPUs use the checkpoint's dtype
        name = "float32" if device.type == "cpu" else model_dtype
        if device.type == "cuda" and name == "float32":
            name = "bfloat16"
    if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("this GPU does not support bfloat16; use dtype='float16'")
    return DTYPES[name]


class ModelRunner:
    """Owns the model and its KV cache; turns a scheduled batch into one forward pass.

    `launch` queues the step on the device and returns at once on a GPU; `collect` waits
    for its sampled tokens. Between the two the engine can schedule the next step.
    """

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        model_config: ModelConfig,
        max_model_len: int | None,
        eos_token_ids: set[int],
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.eos_token_ids = eos_token_ids
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        self.block_size = config.block_size
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        compile_layers.set_enabled(config.torch_compile)
        if self.device.type == "cuda":  # fused.py needs triton, which CPU installs may lack
            from nanovllm.model.layers import fused

            fused.set_enabled(config.fused_kernels)
        self._one_pass = self.device.type == "cuda" and config.fused_kernels
        max_position = max(max_model_len or 0, model_config.max_position_embeddings)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(model_config, max_position)
        finally:
            torch.set_default_dtype(prev)
        load_weights(self.model, source.tensors())
        self.model.eval()
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        self.graphs = None
        self.buffers: InputBuffers | None = None
        self._token_ring: list[torch.Tensor] = []
        self._event_ring: list[torch.cuda.Event] = []
        self._ring_turn = 0

    # ---- KV cache -------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_token() * self.block_size
        if self.config.kv_cache_gib is not None:
            budget = self.config.kv_cache_gib * 2**30
        elif self.device.type == "cuda":
            peak = self._profile_activation_bytes()
            # the allocator keeps the profiling pass's memory cached (not emptied), so the
            # first large step of real work finds it there instead of calling cudaMalloc;
            # that cached pool counts as free here, the peak is set aside once
            free, total = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
                self.device)
            budget = free + cached - total * (1 - self.config.gpu_memory_utilization) - peak
        else:
            budget = CPU_KV_CACHE_GIB * 2**30
        num = int(budget // per_block)
        if num < 1:
            raise ConfigError(
                "no memory left for the KV cache; raise gpu_memory_utilization or kv_cache_gib, "
                "or lower max_num_batched_tokens"
            )
        return num

    @torch.inference_mode()
    def _profile_activation_bytes(self) -> int:
        """Peak memory of the largest step: a full token budget of prefill, then sampling."""
        cfg = self.config
        tokens = cfg.max_num_batched_tokens
        row_len = min(tokens, self.model_config.max_position_embeddings)
        rows = -(-tokens // row_len)
        blocks = rows * -(-row_len // self.block_size)
        self.num_blocks = blocks
        self._allocate_kv_cache(quiet=True)
        seqs = []
        for i in range(rows):
            n = min(row_len, tokens - i * row_len)
            seqs.append(_dummy_seq(i, n, n, i * (blocks // rows), self.block_size))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        inputs = prepare_inputs(ScheduledBatch(seqs), self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        del hidden
        # sampling is largest at max_num_seqs rows of logits
        logits = self.model.compute_logits(
            torch.zeros(
                cfg.max_num_seqs,
                self.model_config.hidden_size,
                device=self.device,
                dtype=self.dtype,
            )
        )
        sample(
            logits,
            build_sampling_tensors(
                [_PROFILE_PARAMS] * cfg.max_num_seqs,
                [[0]] * cfg.max_num_seqs,
                [[]] * cfg.max_num_seqs,
                set(),
                logits.shape[-1],
                self.device,
            ),
        )
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del logits
        self.kv_cache = None
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        return peak

    def _allocate_kv_cache(self, quiet: bool = False) -> None:
        cfg = self.model_config
        shape = (
            2,
            cfg.num_hidden_layers,
            self.num_blocks,
            self.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        if self.device.type == "cpu":
            # anonymous mmap pages are zeroed by the OS when first touched: no 2 GiB memset
            numel = 1
            for d in shape:
                numel *= d
            self._kv_buffer = mmap.mmap(-1, numel * torch.empty(0, dtype=self.dtype).element_size())
            self.kv_cache = torch.frombuffer(self._kv_buffer, dtype=self.dtype).view(shape)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]
        if not quiet:
            gib = self.kv_cache.numel() * self.kv_cache.element_size() / 2**30
            log.info(
                "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%s)",
                self.num_blocks,
                self.block_size,
                self.num_blocks * self.block_size,
                gib,
                self.dtype,
            )

    # ---- start-up warm-up ---------------------------------------------------------

    @torch.inference_mode()
    def setup_steps(self, max_model_len: int) -> None:
        """Persistent step buffers, then (on CUDA) kernel warm-up and graph capture."""
        cfg = self.config
        self.buffers = InputBuffers(
            max(cfg.max_num_batched_tokens, cfg.max_num_seqs), cfg.max_num_seqs,
            -(-max_model_len // self.block_size), self.block_size, self.device,
        )
        if self.device.type == "cuda":
            # pinned buffers for sampled tokens; at most two steps are ever in flight
            self._token_ring = [
                torch.empty(cfg.max_num_seqs, dtype=torch.int64, pin_memory=True)
                for _ in range(3)
            ]
            self._event_ring = [torch.cuda.Event() for _ in range(3)]
            self.warmup_kernels(max_model_len)
        self.capture_graphs(max_model_len)

    @torch.inference_mode()
    def warmup_kernels(self, max_model_len: int) -> None:
        """Run one step of each batch shape class (decode, mixed, prefill chunks of several
        lengths) so Triton compiles its kernel variants now, not inside the first requests.

        Writes only into blocks that no sequence owns yet (nothing is cached at start-up).
        Positions stay below max_model_len (the RoPE table may end there).
        """
        bs = self.block_size
        longest = min(self.config.max_num_batched_tokens - 1, 1024, max_model_len - 1)
        q_lens = sorted({min(n, longest) for n in (8, 16, 32, 128, longest)})
        decode_ctx = min(2 * bs + 1, max_model_len)
        for q_len in q_lens:
            rows = [(q_len, q_len), (1, decode_ctx)]  # (tokens this step, context length)
            seqs, first = [], 0
            for i, (n, ctx) in enumerate(rows):
                if first + -(-ctx // bs) > self.num_blocks:
                    return
                seqs.append(_dummy_seq(i, ctx, n, first, bs))
                first += len(seqs[-1].block_table)
            for batch in (ScheduledBatch(seqs), ScheduledBatch(seqs[:1])):
                # the engine's own buffers: Triton specializes on their strides
                self._logits(self.buffers.prepare(batch))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- CUDA graphs ------------------------------------------------------------

    def capture_graphs(self, max_model_len: int) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        from nanovllm.worker.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.buffers, self.config.max_num_seqs,
                                   max_model_len)
        self.graphs.capture()
        log.info("captured CUDA graphs for decode batch sizes %s", self.graphs.sizes)

    # ---- one step ---------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: StepHandle | None = None) -> StepHandle:
        """Queue one forward pass and sampling; tokens of `prev` still on the device are
        read there (CPU/GPU overlap)."""
        seqs = batch.sampling_seqs
        if self.buffers is None:
            raise RuntimeError("ModelRunner.setup_steps(max_model_len) must run before launch")
        pad = 0
        if self.graphs is not None and all(s.num_scheduled_tokens == 1 for s in batch.seqs):
            pad = self.graphs.padded_size(len(batch.seqs)) or 0
        params = [s.sampling_params for s in seqs]
        # the common batch (temperature or greedy only) samples in one kernel, its
        # temperatures riding in the inputs' copy: no sampling tensors to build
        one_pass = self._one_pass and all(p.plain for p in params)
        temps = [p.temperature for p in params] if one_pass else None
        inputs = self.buffers.prepare(batch, pad, prev.rows if prev is not None else None, temps)
        self._fill_placeholders(inputs, prev)
        logits = self._logits(inputs)
        if not seqs:
            return StepHandle([], {}, None, None, None, False)
        if one_pass:
            from nanovllm.model.layers.triton_sampler import gumbel_argmax

            tokens = gumbel_argmax(logits, inputs.temperatures, MIN_TEMPERATURE)
            return self._handle(seqs, SamplerOutput(tokens, None), False)
        want_logprobs = any(p.logprobs is not None for p in params)
        if any(p.uses_penalties for p in params):
            prompts = [s.token_ids[: s.num_prompt_tokens] for s in seqs]
            outputs = [s.output_token_ids for s in seqs]
        else:  # only the output lengths are read: skip copying every sequence's tokens
            prompts = [()] * len(seqs)
            outputs = [range(s.num_output_tokens) for s in seqs]
        tensors = build_sampling_tensors(
            params, prompts, outputs, self.eos_token_ids, logits.shape[-1], self.device
        )
        return self._handle(seqs, sample(logits, tensors), want_logprobs)

    def _handle(self, seqs: list[Sequence], out: SamplerOutput, want_logprobs: bool):
        rows = {s.seq_id: i for i, s in enumerate(seqs)}
        if self.device.type == "cuda":
            k = self._ring_turn
            self._ring_turn = (k + 1) % len(self._token_ring)
            host = self._token_ring[k][: len(seqs)]
            host.copy_(out.token_ids, non_blocking=True)
            event = self._event_ring[k]
            event.record()
            return StepHandle(seqs, rows, out, host, event, want_logprobs)
        return StepHandle(seqs, rows, out, out.token_ids, None, want_logprobs)

    def _fill_placeholders(self, inputs: StepInputs, prev: StepHandle | None) -> None:
        if not inputs.placeholder_seq_ids:
            return
        assert prev is not None and prev.out is not None, "a placeholder with no step in flight"
        tokens = prev.out.token_ids.index_select(0, inputs.placeholder_rows)
        inputs.input_ids.index_copy_(0, inputs.placeholder_positions, tokens)

    def _logits(self, inputs: StepInputs) -> torch.Tensor:
        graphs = self.graphs
        if graphs is not None and inputs.decode_only and inputs.padded_rows in graphs.graphs:
            return self.graphs.replay(inputs.padded_rows, inputs.num_sampling_rows)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.num_sampling_rows == 0:
            return hidden[:0]
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    def collect(self, handle: StepHandle) -> StepOutput:
        """Wait for a launched step's tokens (and logprobs) and bring them to the host."""
        if handle.out is None:
            return StepOutput([], [])
        if handle.event is not None:
            handle.event.synchronize()
        token_ids = handle.host_tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(handle.seqs)
        if handle.want_logprobs:
            out = handle.out
            lp = out.logprobs.tolist()
            top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for i, seq in enumerate(handle.seqs):
                k = seq.sampling_params.logprobs
                if k is None:
                    continue
                entry = {token_ids[i]: lp[i]}
                if top_ids is not None:
                    entry.update(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                logprobs[i] = entry
        return StepOutput(token_ids, logprobs)

    def run(self, batch: ScheduledBatch) -> StepOutput:
        return self.collect(self.launch(batch))


def _dummy_seq(
    i: int, context_len: int, num_new: int, first_block: int, block_size: int
) -> Sequence:
    """A sequence of `context_len` zero tokens whose last `num_new` run this step, on
    consecutive blocks from `first_block` (start-up profiling and warm-up only)."""
    seq = Sequence(-1 - i, [0] * context_len, _PROFILE_PARAMS)
    seq.block_table = list(range(first_block, first_block + -(-context_len // block_size)))
    seq.num_computed_tokens = context_len - num_new
    seq.num_scheduled_tokens = num_new
    return seq


def _profile_params():
    from nanovllm.core.sampling_params import SamplingParams

    return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)


_PROFILE_PARAMS = _profile_params()
