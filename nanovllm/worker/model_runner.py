import logging
import mmap
from dataclasses import dataclass

import torch

from nanovllm.core.config import EngineConfig
from nanovllm.core.errors import ConfigError
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.model.attention.metadata import AttentionMetadata
from nanovllm.model.config import ModelConfig
from nanovllm.model.layers.sampler import sample
from nanovllm.model.loader.source import ModelSource
from nanovllm.model.loader.weights import load_weights
from nanovllm.model.models.registry import build_model
from nanovllm.worker.sampling_metadata import build_sampling_tensors

log = logging.getLogger("nanovllm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_GIB = 2.0


@dataclass
class StepOutput:
    """One sampled token per sampling row, and its logprobs when asked for."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


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
    """Owns the model and its KV cache; turns a scheduled batch into one forward pass."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        model_config: ModelConfig,
        max_model_len: int | None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        self.block_size = config.block_size
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
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
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # keep headroom for activations of the largest batch
            act = self.config.max_num_batched_tokens * self.model_config.hidden_size * 64
            budget = total * self.config.gpu_memory_utilization - used - act
        else:
            budget = CPU_KV_CACHE_GIB * 2**30
        num = int(budget // per_block)
        if num < 1:
            raise ConfigError(
                "no memory left for the KV cache; raise gpu_memory_utilization or kv_cache_gib"
            )
        return num

    def _allocate_kv_cache(self) -> None:
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
        gib = self.kv_cache.numel() * self.kv_cache.element_size() / 2**30
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%s)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            gib,
            self.dtype,
        )

    # ---- one step ---------------------------------------------------------------

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables: list[list[int]] = []
        for seq in batch.seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            pos = start
            while pos < end:  # one contiguous run of slots per block
                block, offset = divmod(pos, bs)
                run = min(bs - offset, end - pos)
                base = table[block] * bs + offset
                slots.extend(range(base, base + run))
                pos += run
            query_lens.append(n)
            context_lens.append(end)
            tables.append(table + [0] * (max_blocks - len(table)))
            if end == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
        dev = self.device

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype, device=dev)

        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            query_start_loc=tensor(starts, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            query_lens_host=query_lens,
            context_lens_host=context_lens,
        )
        return tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta, logits_indices

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, eos_token_ids: set[int]) -> StepOutput:
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        if not logits_indices:
            return StepOutput([], [])
        logits = self.model.compute_logits(hidden[logits_indices])
        seqs = batch.sampling_seqs
        tensors = build_sampling_tensors(
            [s.sampling_params for s in seqs],
            [s.token_ids[: s.num_prompt_tokens] for s in seqs],
            [s.output_token_ids for s in seqs],
            eos_token_ids,
            logits.shape[-1],
            self.device,
        )
        out = sample(logits, tensors)
        token_ids = out.token_ids.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        if tensors.max_logprobs > 0 or any(s.sampling_params.logprobs is not None for s in seqs):
            lp = out.logprobs.tolist()
            top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for i, seq in enumerate(seqs):
                k = seq.sampling_params.logprobs
                if k is None:
                    continue
                entry = {token_ids[i]: lp[i]}
                if top_ids is not None:
                    entry.update(zip(top_ids[i][:k], top_lps[i][:k]))
                logprobs[i] = entry
        return StepOutput(token_ids, logprobs)
