"""Steps over dummy sequences at start-up: the memory profile that sizes a GPU's KV cache,
and the kernel warm-up that compiles Triton's variants before the first request. Each
takes the ModelRunner that calls it (its model, config, buffers and sampler), which imports
this module, not the other way round."""

from __future__ import annotations

import torch

from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.worker.inputs import prepare_inputs
from nanovllm.worker.kv_cache import KVCache

# the sampler's most memory-hungry path: top-k and top-p sort every row
PROFILE_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)


def dummy_seq(i: int, context_len: int, num_new: int, first_block: int, block_size: int):
    """A sequence of `context_len` zero tokens whose last `num_new` run this step, on
    consecutive blocks from `first_block`."""
    seq = Sequence(-1 - i, [0] * context_len, PROFILE_PARAMS)
    seq.block_table = list(range(first_block, first_block + -(-context_len // block_size)))
    seq.num_computed_tokens = context_len - num_new
    seq.num_scheduled_tokens = num_new
    return seq


@torch.inference_mode()
def profile_activation_bytes(runner) -> int:
    """Peak GPU memory of the largest step: a full token budget of prefill, then sampling
    max_num_seqs rows. Runs over a temporary cache just large enough for it."""
    cfg, bs = runner.config, runner.config.block_size
    tokens = cfg.max_num_batched_tokens
    row_len = min(tokens, runner.model_config.max_position_embeddings)
    rows = -(-tokens // row_len)
    blocks = rows * -(-row_len // bs)
    cache = KVCache(runner.model_config, blocks, bs, runner.kv_format, runner.device)
    cache.bind(runner.model)
    seqs = [
        dummy_seq(i, n, n, i * (blocks // rows), bs)
        for i, n in enumerate(min(row_len, tokens - i * row_len) for i in range(rows))
    ]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    inputs = prepare_inputs(ScheduledBatch(seqs), bs, runner.device)
    runner.model(inputs.input_ids, inputs.positions, inputs.meta)  # its output is freed here
    hidden = torch.zeros(cfg.max_num_seqs, runner.model_config.hidden_size,
                         device=runner.device, dtype=runner.dtype)
    logits = runner.model.compute_logits(hidden)
    runner.sampler.sample(logits, [seqs[0]] * cfg.max_num_seqs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del logits, cache
    KVCache.unbind(runner.model)
    return peak


@torch.inference_mode()
def warm_up_kernels(runner) -> None:
    """Run one step of each batch shape class (decode, mixed, prefill chunks of several
    lengths) so Triton compiles its kernel variants now, not inside the first requests.

    Writes only into blocks that no sequence owns yet (nothing is cached at start-up).
    Positions stay below max_model_len (the RoPE table may end there).
    """
    cfg, bs = runner.config, runner.config.block_size
    longest = min(cfg.max_num_batched_tokens - 1, 1024, cfg.max_model_len - 1)
    q_lens = sorted({min(n, longest) for n in (8, 16, 32, 128, longest)})
    decode_ctx = min(2 * bs + 1, cfg.max_model_len)
    for q_len in q_lens:
        rows = [(q_len, q_len), (1, decode_ctx)]  # (tokens this step, context length)
        seqs, first = [], 0
        for i, (n, ctx) in enumerate(rows):
            if first + -(-ctx // bs) > cfg.num_kv_blocks:
                return
            seqs.append(dummy_seq(i, ctx, n, first, bs))
            first += len(seqs[-1].block_table)
        for batch in (ScheduledBatch(seqs), ScheduledBatch(seqs[:1])):
            # the engine's own buffers: Triton specializes on their strides
            runner.logits(runner.buffers.prepare(batch))
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
