"""CUDA graphs: for decode steps, one graph per batch size of a ladder, replayed with the
batch padded up to the next size; for prefill+decode ("mixed") steps, one graph per token
count of a second ladder, every row of the buffers in each. Padded rows and tokens write no
KV (slot -1) and attend to nothing (context length 0), so they cannot touch real rows.

Mixed steps can be captured because the Triton attention launches depend only on the token
and row counts and the longest query and context allowed (kernels/triton_attention.py and
the decode and prefill modules it calls): a graph captured for T tokens, every row, queries
up to T and contexts up to max_model_len serves any step of T tokens. The ladder stops at
MIXED_GRAPH_MAX_TOKENS: past it a step's matmuls dwarf its launches, and padding would cost
more than the graph saves.
"""

import torch

from nanovllm.kernels.attention_metadata import AttentionMetadata
from nanovllm.worker.inputs import InputBuffers

MIXED_GRAPH_MAX_TOKENS = 2048
# replay each graph once as it is captured, over its capture inputs (which touch nothing),
# so the driver's one-time work on a graph's first launch is done at start-up, not in the
# first requests' steps (benchmarks/first_replay.py measures it)
REPLAY_AFTER_CAPTURE = True


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts of the mixed-step graphs: steps of 64 tokens up to 512, of 128 up to
    1,024, of 256 up to 2,048 (at most 20% padding past 256 tokens), and the step limit
    where that is lower."""
    cap = min(max_tokens, MIXED_GRAPH_MAX_TOKENS)
    sizes = list(range(64, 513, 64)) + list(range(640, 1025, 128)) + list(range(1280, 2049, 256))
    return [s for s in sizes if s < cap] + [cap]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class GraphLadder:
    """Graphs captured over `InputBuffers`' device tensors, one per size of a ladder (rows
    for decode, tokens for mixed steps): a step prepared padded up to `padded_size` is
    already in place, so `replay` launches nothing else."""

    def __init__(
        self, model: torch.nn.Module, buffers: InputBuffers, sizes: list[int],
        max_model_len: int,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _forward(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    def _capture_inputs(self, size: int) -> None:
        """Consistent inputs to capture `size` over, written outside the graph."""

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every size, largest first, so smaller graphs reuse its memory pool (and
        `pool`, another ladder's); returns the pool."""
        self.buffers.reset()
        for size in reversed(self.sizes):
            self._capture_inputs(size)
            self._forward(size)  # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
            if REPLAY_AFTER_CAPTURE:
                graph.replay()
        torch.cuda.synchronize()
        return pool

    def padded_size(self, n: int) -> int | None:
        """The graph size a step of `n` (rows or tokens) runs at; None if too large."""
        return next((s for s in self.sizes if s >= n), None)

    def replay(self, size: int, num_rows: int) -> torch.Tensor:
        """Logits [num_rows, V] of a step already written into the buffers."""
        self.graphs[size].replay()
        return self.logits[size][:num_rows]


class DecodeGraphs(GraphLadder):
    """Decode graphs, keyed by batch size: the reset buffers' rows of one token each."""

    def __init__(
        self, model: torch.nn.Module, buffers: InputBuffers, max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        super().__init__(model, buffers, graph_batch_sizes(max_num_seqs), max_model_len)

    def _meta(self, bs: int) -> AttentionMetadata:
        # host-side values are those of the worst case, so launch shapes fit any batch
        b = self.buffers
        return AttentionMetadata(
            slot_mapping=b.slots(bs),
            query_start_loc=b.query_start_loc(bs),
            context_lens=b.context_lens(bs),
            block_tables=b.block_tables(bs),
            max_query_len=1,
            max_context_len=self.max_model_len,
            query_lens_host=[1] * bs,
            context_lens_host=[self.max_model_len] * bs,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        b = self.buffers
        hidden = self.model(b.input_ids(bs), b.positions(bs), self._meta(bs))
        return self.model.compute_logits(hidden)


class MixedGraphs(GraphLadder):
    """Prefill+decode graphs, keyed by token count, each over every row of the buffers; a
    step prepared with `pad_rows=rows`, `pad_tokens=padded_size(tokens)` is in place."""

    def __init__(
        self, model: torch.nn.Module, buffers: InputBuffers, max_tokens: int, max_model_len: int,
    ) -> None:
        super().__init__(model, buffers, mixed_graph_sizes(max_tokens), max_model_len)
        self.rows = buffers.R

    def _meta(self, tokens: int) -> AttentionMetadata:
        # the worst case again: queries up to `tokens` long (the prefill tile), a decode row
        # (so the decode kernel is launched too), contexts up to max_model_len (its splits)
        b, rows = self.buffers, self.rows
        return AttentionMetadata(
            slot_mapping=b.slots(tokens),
            query_start_loc=b.query_start_loc(rows),
            context_lens=b.context_lens(rows),
            block_tables=b.block_tables(rows),
            max_query_len=tokens,
            max_context_len=self.max_model_len,
            query_lens_host=[1] * rows,
            context_lens_host=[self.max_model_len] * rows,
        )

    def _capture_inputs(self, tokens: int) -> None:
        # the first row holds every token (context 0, as a padding row), the others none
        qsl = self.buffers.query_start_loc(self.rows)
        qsl.fill_(tokens)
        qsl[0] = 0

    def _forward(self, tokens: int) -> torch.Tensor:
        b = self.buffers
        hidden = self.model(b.input_ids(tokens), b.positions(tokens), self._meta(tokens))
        # every row's last token (unused rows point at token 0), as the step's rows vary
        return self.model.compute_logits(hidden.index_select(0, b.logits_indices(self.rows)))

    def serves(self, inputs) -> bool:
        """Whether prepared `inputs` are a mixed step laid out for one of these graphs (a
        pure function of the inputs, so every tensor-parallel rank agrees)."""
        return (not inputs.decode_only and inputs.padded_rows == self.rows
                and inputs.input_ids.shape[0] in self.graphs)
