"""Step inputs written into the persistent buffers match a direct construction, including
graph padding, placeholders, and a decode step after a prefill step in the same buffers, on
the CPU and (marked gpu) on CUDA."""

import pytest
import torch

from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.scheduler import PLACEHOLDER, ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.worker.inputs import InputBuffers

BS = 4


def seq(seq_id, tokens, computed, scheduled, first_block):
    s = Sequence(seq_id, list(tokens), SamplingParams(max_tokens=4))
    s.block_table = [first_block + 3 * i for i in range(-(-len(tokens) // BS))]
    s.num_computed_tokens, s.num_scheduled_tokens = computed, scheduled
    return s


def expected(seqs):
    ids, pos, slots, qsl, ctx, logits = [], [], [], [0], [], []
    for s in seqs:
        for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(s.block_table[p // BS] * BS + p % BS)
        qsl.append(len(ids))
        ctx.append(s.num_computed_tokens + s.num_scheduled_tokens)
        if ctx[-1] == s.num_tokens:
            logits.append(len(ids) - 1)
    return ids, pos, slots, qsl, ctx, logits


def check(inputs, seqs, pad=0):
    ids, pos, slots, qsl, ctx, logits = expected(seqs)
    n = len(ids)
    assert inputs.input_ids[:n].tolist() == ids
    assert inputs.positions[:n].tolist() == pos
    assert inputs.meta.slot_mapping.tolist() == slots + [-1] * pad
    assert inputs.meta.query_start_loc.tolist() == qsl + [n + i for i in range(1, pad + 1)]
    assert inputs.meta.context_lens.tolist() == ctx + [0] * pad
    assert inputs.logits_indices.tolist() == logits
    for row, s in enumerate(seqs):
        table = inputs.meta.block_tables[row].tolist()
        assert table[: len(s.block_table)] == s.block_table


def test_prefill_then_padded_decode_with_placeholders(device):
    # on CUDA through the pinned host arrays used in turn
    buf = InputBuffers(max_tokens=32, max_rows=8, table_width=5, block_size=BS,
                       device=torch.device(device))
    prefill = [seq(0, range(10, 19), 0, 9, 0), seq(1, range(30, 36), 2, 3, 1)]
    inputs = buf.prepare(ScheduledBatch(prefill))
    check(inputs, prefill)
    assert inputs.num_sampling_rows == 1 and not inputs.decode_only
    # decode rows in the same buffers: query starts go back to 0..n, padding to 8 rows
    decode = [seq(0, [*range(10, 19), PLACEHOLDER], 9, 1, 0),
              seq(1, range(30, 37), 6, 1, 1), seq(2, [5] * 13, 12, 1, 2)]
    inputs = buf.prepare(ScheduledBatch(decode), pad_rows=8, prev_rows={0: 4},
                         temperatures=[0.0, 0.6, 1.5])
    check(inputs, decode, pad=5)
    assert inputs.temperatures.dtype == torch.float32
    assert inputs.temperatures.tolist() == pytest.approx([0.0, 0.6, 1.5])
    assert inputs.decode_only and inputs.padded_rows == 8
    assert inputs.placeholder_positions.tolist() == [0]
    assert inputs.placeholder_rows.tolist() == [4]
    assert inputs.placeholder_seq_ids == [0]
    assert inputs.meta.query_lens_host == [1] * 8
    assert inputs.meta.context_lens_host == [10, 7, 13, 0, 0, 0, 0, 0]
    assert inputs.input_ids.shape[0] == 8


def test_block_tables_follow_their_lists_across_steps(device):
    """Rows come from each table's int32 copy, grown by what was appended since the last
    step: a table that grows, one replaced by a new list of the same length (a preempted
    sequence prefilled again into other blocks), rows that change places, and sequences
    that leave (their copies are forgotten) while a new one takes a used id."""
    buf = InputBuffers(max_tokens=32, max_rows=2, table_width=6, block_size=BS,
                       device=torch.device(device))
    a, b = seq(0, range(8), 7, 1, 0), seq(1, range(5), 4, 1, 1)
    check(buf.prepare(ScheduledBatch([a, b])), [a, b])
    a.block_table.append(40)  # grows: one more block
    a.token_ids += [1] * 4
    a.num_computed_tokens = 8
    check(buf.prepare(ScheduledBatch([b, a])), [b, a])  # and the rows swap
    b.block_table = [50, 51]  # freed and allocated again: same length, other blocks
    check(buf.prepare(ScheduledBatch([a, b])), [a, b])
    b.block_table.append(52)
    b.token_ids += [1] * 4
    b.num_computed_tokens = 8
    check(buf.prepare(ScheduledBatch([a, b])), [a, b])
    for i in range(2, 8):  # more sequences than 2 x rows pass through
        others = [seq(i, range(6), 5, 1, i), seq(i + 100, range(3), 2, 1, 2 * i)]
        check(buf.prepare(ScheduledBatch(others)), others)
    assert len(buf._tables) <= 2 * 2 + 2
    again = seq(0, range(12), 11, 1, 60)  # id 0 again, a new table
    check(buf.prepare(ScheduledBatch([again])), [again])
