"""CUDA graphs for decode steps: one graph per batch size of a ladder, replayed with the
batch padded up to the next size. Padded rows write no KV (slot -1) and attend to nothing
(context length 0), so they cannot touch real rows. Prefill+decode steps run eagerly: their
matmuls dwarf their launches.
"""

import torch

from nanovllm.kernels.attention_metadata import AttentionMetadata
from nanovllm.worker.inputs import InputBuffers


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    """Decode graphs captured over `InputBuffers`' device tensors, keyed by batch size: a
    step prepared padded up to `padded_size` is already in place, so `replay` launches
    nothing else."""

    def __init__(
        self, model: torch.nn.Module, buffers: InputBuffers, max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, so smaller graphs reuse its memory pool. Each
        graph is replayed once over its capture inputs (which touch nothing), so the driver's
        one-time work on a graph's first launch is done at start-up, not in the first
        requests' steps."""
        self.buffers.reset()
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
            graph.replay()
        torch.cuda.synchronize()

    def padded_size(self, n: int) -> int | None:
        """The graph size a step of `n` rows runs at; None if too large."""
        return next((s for s in self.sizes if s >= n), None)

    def replay(self, size: int, num_rows: int) -> torch.Tensor:
        """Logits [num_rows, V] of a step already written into the buffers."""
        self.graphs[size].replay()
        return self.logits[size][:num_rows]

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
