"""A scheduled batch as flat tensors: the inputs of one forward pass.

`InputBuffers` keeps every step input at a fixed place in two persistent device tensors
(one int64, one int32), filled from pinned host arrays by one copy per dtype. Fixed
addresses let a captured CUDA graph read a decode step's inputs where they land, with no
copy kernels, and persistent pinned memory spares a pinned allocation per tensor per step.

int64 buffer (T = max tokens per step, R = max rows):
    [0, T) input ids | [T, 2T) positions | [2T, 3T) slots | [3T, 3T+R) logits indices
    | [3T+R, 3T+2R) placeholder token positions | [3T+2R, 3T+3R) their rows in the
    previous step's sampled tokens
int32 buffer (W = block table width, fixed: ceil(max_model_len / block_size)):
    [0, R+1) query start locations | [R+1, 2R+1) context lengths | [2R+1, 3R+1) sampling
    temperatures (float32 bits, when the runner samples in one pass) | [3R+1, 3R+1+R*W)
    block tables
"""

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import PLACEHOLDER
from nanovllm.kernels.attention_metadata import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the last token of each sampling row
    num_sampling_rows: int
    decode_only: bool
    # flat token positions whose token is still on the device ([P] int64), and the row of
    # the previous step's sampled tokens that holds each ([P] int64); P may be 0
    placeholder_positions: torch.Tensor
    placeholder_rows: torch.Tensor
    placeholder_seq_ids: list[int]
    padded_rows: int  # rows including padding (a CUDA graph's batch size), >= the batch's
    temperatures: torch.Tensor | None = None  # [S] float32, when given to `prepare`


class InputBuffers:
    """Persistent step-input storage (see the module docstring for the layout).

    On CUDA the host side is two sets of pinned arrays used in turn: a set is rewritten
    only after the copy queued from it two steps ago has run (an event says so), so the
    host never waits on the step in flight. On CPU the host arrays are the tensors.
    """

    def __init__(
        self, max_tokens: int, max_rows: int, table_width: int, block_size: int,
        device: torch.device,
    ) -> None:
        T, R, W = max_tokens, max_rows, table_width
        self.T, self.R, self.W, self.block_size, self.device = T, R, W, block_size, device
        self.n64, self.n32 = 3 * T + 3 * R, 3 * R + 1 + R * W
        self.tables_at = 3 * R + 1
        self.dev64 = torch.zeros(self.n64, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(self.n32, dtype=torch.int32, device=device)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.hosts = [
                (torch.zeros(self.n64, dtype=torch.int64, pin_memory=True),
                 torch.zeros(self.n32, dtype=torch.int32, pin_memory=True))
                for _ in range(2)
            ]
            self.events: list[torch.cuda.Event | None] = [None, None]
        else:
            self.hosts = [(self.dev64, self.dev32)]
        self._turn = 0
        self._arange = np.arange(R + 1, dtype=np.int32)
        # each running sequence's block table as int32, grown by what it appended since:
        # writing a row from a list converts every entry, each step (most of `prepare`'s
        # time at 256 rows of ~100 blocks); seq_id -> (the list, its int32 copy, entries)
        self._tables: dict[int, tuple[list[int], np.ndarray, int]] = {}
        self.reset()

    def reset(self) -> None:
        """Inputs that make every row harmless: one token, slot -1 (no KV write), context 0
        (attends to nothing). CUDA graphs are captured over this state."""
        T, R = self.T, self.R
        for b64, b32 in [(self.dev64, self.dev32)] + self.hosts:
            b64.zero_()
            b64[2 * T : 3 * T].fill_(-1)
            b32.zero_()
            b32[: R + 1].copy_(torch.from_numpy(self._arange))

    # device views at fixed addresses (what a CUDA graph captures)
    def input_ids(self, n: int) -> torch.Tensor:
        return self.dev64[:n]

    def positions(self, n: int) -> torch.Tensor:
        return self.dev64[self.T : self.T + n]

    def slots(self, n: int) -> torch.Tensor:
        return self.dev64[2 * self.T : 2 * self.T + n]

    def logits_indices(self, rows: int) -> torch.Tensor:
        return self.dev64[3 * self.T : 3 * self.T + rows]

    def query_start_loc(self, rows: int) -> torch.Tensor:
        return self.dev32[: rows + 1]

    def context_lens(self, rows: int) -> torch.Tensor:
        return self.dev32[self.R + 1 : self.R + 1 + rows]

    def block_tables(self, rows: int) -> torch.Tensor:
        start = self.tables_at
        return self.dev32[start : start + rows * self.W].view(rows, self.W)

    def prepare(
        self, batch: ScheduledBatch, pad_rows: int = 0, prev_rows: dict[int, int] | None = None,
        temperatures: list[float] | None = None,
    ) -> StepInputs:
        """Write `batch` into the next host set and queue its copy to the device.

        `pad_rows` > rows pads a decode batch up to a CUDA graph's batch size: padding rows
        have one token, slot -1 and context 0. `prev_rows` maps a sequence id to its row in
        the previous step's sampled tokens (needed when the batch has placeholders).
        `temperatures` (one per sampling row) ride along in the same copy.
        """
        T, R, W, bs = self.T, self.R, self.W, self.block_size
        seqs = batch.seqs
        r = len(seqs)
        padded = max(pad_rows, r)
        k = self._turn
        self._turn = (k + 1) % len(self.hosts)
        if self.cuda and self.events[k] is not None:
            self.events[k].synchronize()  # its copy ran long ago; this does not wait
        h64_t, h32_t = self.hosts[k]
        h64, h32 = h64_t.numpy(), h32_t.numpy()

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        ph_pos: list[int] = []
        ph_seq: list[int] = []
        # each row's block table as W entries (0 past it), gathered below in one copy
        table_rows: list[np.ndarray] = []
        for seq in seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            end = start + n
            table = seq.block_table
            if n == 1:
                token = seq.token_ids[start]
                if token == PLACEHOLDER:
                    ph_pos.append(len(input_ids))
                    ph_seq.append(seq.seq_id)
                input_ids.append(token)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                tokens = seq.token_ids[start:end]
                if tokens[-1] == PLACEHOLDER:  # only ever the last token of a sequence
                    ph_pos.append(len(input_ids) + n - 1)
                    ph_seq.append(seq.seq_id)
                input_ids.extend(tokens)
                positions.extend(range(start, end))
                pos = start
                while pos < end:  # one contiguous run of slots per block
                    block, offset = divmod(pos, bs)
                    run = min(bs - offset, end - pos)
                    base = table[block] * bs + offset
                    slots.extend(range(base, base + run))
                    pos += run
            query_lens.append(n)
            context_lens.append(end)
            table_rows.append(self._table_row(seq.seq_id, table))
            if end == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
        if r:  # one copy of every row's table (a slice assignment per row cost ~0.6 us)
            np.concatenate(table_rows, out=h32[self.tables_at : self.tables_at + r * W])
        if len(self._tables) > 2 * R:  # forget the sequences that left
            live = {seq.seq_id for seq in seqs}
            self._tables = {k: v for k, v in self._tables.items() if k in live}
        t, s, p = len(input_ids), len(logits_indices), len(ph_pos)
        pad = padded - r  # padding rows: one token each
        if t + pad > T or padded > R:
            raise ValueError(f"a step of {t + pad} tokens / {padded} rows exceeds the buffers")
        h64[:t] = input_ids
        h64[T : T + t] = positions
        h64[2 * T : 2 * T + t] = slots
        h64[3 * T : 3 * T + s] = logits_indices
        if p:
            assert prev_rows is not None, "placeholder tokens but no step in flight"
            h64[3 * T + R : 3 * T + R + p] = ph_pos
            h64[3 * T + 2 * R : 3 * T + 2 * R + p] = [prev_rows[sid] for sid in ph_seq]
        h32[R + 1 : R + 1 + r] = context_lens
        if temperatures is not None:
            h32[2 * R + 1 : 2 * R + 1 + s].view(np.float32)[:] = temperatures
        if pad:
            h64[t : t + pad] = 0
            h64[T + t : T + t + pad] = 0
            h64[2 * T + t : 2 * T + t + pad] = -1
            h32[R + 1 + r : R + 1 + padded] = 0
        max_query_len = max(query_lens)
        if max_query_len == 1:
            h32[: padded + 1] = self._arange[: padded + 1]
        else:
            h32[1 : r + 1] = np.cumsum(query_lens)
            h32[r + 1 : padded + 1] = t + np.arange(1, pad + 1)

        if self.cuda:
            # the int64 copy always spans the fixed regions; ~400 KB at the default budget
            end64 = 3 * T + 2 * R + p
            self.dev64[:end64].copy_(h64_t[:end64], non_blocking=True)
            end32 = self.tables_at + padded * W
            self.dev32[:end32].copy_(h32_t[:end32], non_blocking=True)
            event = self.events[k] or torch.cuda.Event()
            event.record()
            self.events[k] = event
        return self.received(t + pad, s, padded, max_query_len, max(context_lens),
                             query_lens + [1] * pad, context_lens + [0] * pad, p, ph_seq,
                             temperatures is not None)

    def _table_row(self, seq_id: int, table: list[int]) -> np.ndarray:
        """`table` as a row of W int32 (0 past it: the torch backend gathers a batch's
        widest table for every row, then masks), converting only the entries added since
        the last step."""
        n = len(table)
        cached = self._tables.get(seq_id)
        if cached is not None and cached[0] is table and cached[2] <= n:
            _, row, done = cached
            if done == n:  # the usual decode step: no new block
                return row
            row[done:n] = table[done:]
        else:  # a new sequence, or its table was replaced (freed, preempted)
            row = np.zeros(self.W, dtype=np.int32)  # past the table: block 0, in bounds
            row[:n] = table
        self._tables[seq_id] = (table, row, n)
        return row

    def received(
        self, tokens: int, sampling_rows: int, padded: int, max_query_len: int,
        max_context_len: int, query_lens: list[int], context_lens: list[int],
        placeholders: int = 0, placeholder_seq_ids: list[int] | None = None,
        temperatures: bool = False,
    ) -> StepInputs:
        """The StepInputs of a step whose buffers are in place: prepared here, or (on a
        tensor-parallel rank other than 0) broadcast into them from rank 0's."""
        T, R, s, p = self.T, self.R, sampling_rows, placeholders
        meta = AttentionMetadata(
            slot_mapping=self.slots(tokens),
            query_start_loc=self.query_start_loc(padded),
            context_lens=self.context_lens(padded),
            block_tables=self.block_tables(padded),
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            query_lens_host=query_lens,
            context_lens_host=context_lens,
        )
        return StepInputs(
            input_ids=self.input_ids(tokens),
            positions=self.positions(tokens),
            meta=meta,
            logits_indices=self.logits_indices(s),
            num_sampling_rows=s,
            decode_only=max_query_len == 1,
            placeholder_positions=self.dev64[3 * T + R : 3 * T + R + p],
            placeholder_rows=self.dev64[3 * T + 2 * R : 3 * T + 2 * R + p],
            placeholder_seq_ids=placeholder_seq_ids or [],
            padded_rows=padded,
            temperatures=self.dev32[2 * R + 1 : 2 * R + 1 + s].view(torch.float32)
            if temperatures else None,
        )


def prepare_inputs(batch: ScheduledBatch, block_size: int, device: torch.device) -> StepInputs:
    """One-off inputs for `batch` in buffers sized to it (profiling, tests, warm-up)."""
    tokens = sum(s.num_scheduled_tokens for s in batch.seqs)
    width = max(len(s.block_table) for s in batch.seqs)
    buffers = InputBuffers(tokens, len(batch.seqs), width, block_size, device)
    return buffers.prepare(batch)
