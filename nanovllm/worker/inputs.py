"""A scheduled batch as flat tensors: the inputs of one forward pass."""

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.core.scheduler import PLACEHOLDER, ScheduledBatch
from nanovllm.model.attention.metadata import AttentionMetadata
from nanovllm.worker.staging import to_device


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the last token of each sampling row
    num_sampling_rows: int
    decode_only: bool
    # flat token positions whose token is still on the device, and the row of the previous
    # step's sampled tokens that holds it
    placeholder_positions: list[int]
    placeholder_seq_ids: list[int]


def prepare_inputs(batch: ScheduledBatch, block_size: int, device: torch.device) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    logits_indices: list[int] = []
    ph_pos: list[int] = []
    ph_seq: list[int] = []
    seqs = batch.seqs
    max_blocks = max(len(seq.block_table) for seq in seqs)
    tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for row, seq in enumerate(seqs):
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        end = start + n
        tokens = seq.token_ids[start:end]
        if tokens[-1] == PLACEHOLDER:  # only ever the last token of a sequence
            ph_pos.append(len(input_ids) + n - 1)
            ph_seq.append(seq.seq_id)
        input_ids.extend(tokens)
        table = seq.block_table
        if n == 1:
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            positions.extend(range(start, end))
            pos = start
            while pos < end:  # one contiguous run of slots per block
                block, offset = divmod(pos, block_size)
                run = min(block_size - offset, end - pos)
                base = table[block] * block_size + offset
                slots.extend(range(base, base + run))
                pos += run
        query_lens.append(n)
        context_lens.append(end)
        tables[row, : len(table)] = table
        if end == seq.num_tokens:
            logits_indices.append(len(input_ids) - 1)
    starts = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=starts[1:])
    # two host-to-device copies (one per dtype) instead of one per tensor
    t, r, s = len(input_ids), len(seqs), len(logits_indices)
    i64 = to_device(np.concatenate([input_ids, positions, slots, logits_indices]).astype(np.int64),
                    torch.int64, device)
    i32 = to_device(np.concatenate([starts, np.asarray(context_lens, dtype=np.int32),
                                    tables.ravel()]), torch.int32, device)
    meta = AttentionMetadata(
        slot_mapping=i64[2 * t : 3 * t],
        query_start_loc=i32[: r + 1],
        context_lens=i32[r + 1 : 2 * r + 1],
        block_tables=i32[2 * r + 1 :].view(r, max_blocks),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        query_lens_host=query_lens,
        context_lens_host=context_lens,
    )
    return StepInputs(
        input_ids=i64[:t],
        positions=i64[t : 2 * t],
        meta=meta,
        logits_indices=i64[3 * t : 3 * t + s],
        num_sampling_rows=s,
        decode_only=meta.max_query_len == 1,
        placeholder_positions=ph_pos,
        placeholder_seq_ids=ph_seq,
    )
