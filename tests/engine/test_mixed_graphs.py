"""CUDA graphs for prefill+decode steps (worker/cuda_graph.py MixedGraphs): a step padded to a
graph's token count, with every row of the buffers, gives its real rows what the unpadded
step gives them. On the CPU the padded layout runs eagerly through the Triton kernels (in
Triton's interpreter, the same kernels the graphs capture); on a GPU the graphs replay and
equal the eager engine."""

import pytest
import torch

from nanovllm import LLM, ConfigError
from nanovllm.worker.cuda_graph import MixedGraphs, mixed_graph_sizes
from nanovllm.worker.inputs import InputBuffers
from tests.support import greedy, make_prompts

CHUNKED = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=64,
               block_size=4, max_model_len=128)
PARAMS = greedy(10, logprobs=2)


def _prompts():
    # lengths 9-37, each a prefix of the next (prefix-cache hits): chunked over several
    # steps while earlier prompts decode
    return [p[: 9 + 7 * i] for i, p in enumerate(make_prompts(seed=21, count=5,
                                                              shared_prefix=40))]


class PadOnly:
    """MixedGraphs' padding without its graphs: the padded step then runs eagerly."""

    padded_size = MixedGraphs.padded_size

    def __init__(self, rows: int, sizes: list[int]) -> None:
        self.rows, self.sizes = rows, sizes

    def serves(self, inputs) -> bool:
        return False


def _generate(llm):
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    return [o.token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _assert_same(a, b):
    assert a[0] == b[0]
    for la, lb in zip(a[1], b[1], strict=True):
        for x, y in zip(la, lb, strict=True):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)


def test_mixed_graph_sizes():
    assert mixed_graph_sizes(16) == [16]
    sizes = mixed_graph_sizes(16384)
    assert sizes[0] == 64 and sizes[-1] == 2048 == max(sizes)
    assert all(b > a and (b - a) / b <= 0.2 for a, b in zip(sizes, sizes[1:]) if a >= 256)
    assert mixed_graph_sizes(1000)[-2:] == [896, 1000]


def test_padded_mixed_steps_give_the_unpadded_results(tiny_llama, triton_interpreter):
    plain = LLM(str(tiny_llama), device="cpu", attention_backend="triton", **CHUNKED)
    want = _generate(plain)

    padded = LLM(str(tiny_llama), device="cpu", attention_backend="triton", **CHUNKED)
    runner = padded.engine.runner
    b = runner.buffers
    runner.buffers = InputBuffers(b.T, b.R + 1, b.W, b.block_size, runner.device)
    runner.mixed_graphs = PadOnly(b.R + 1, [8, 16, 24, 32])
    seen = []
    prepare = runner.buffers.prepare

    def recording(batch, pad_rows=0, prev_rows=None, temperatures=None, pad_tokens=0):
        inputs = prepare(batch, pad_rows, prev_rows, temperatures, pad_tokens)
        tokens = sum(s.num_scheduled_tokens for s in batch.seqs)
        seen.append((tokens, pad_tokens, len(batch.seqs), inputs.padded_rows))
        return inputs

    runner.buffers.prepare = recording
    _assert_same(_generate(padded), want)
    mixed = [s for s in seen if s[1]]
    # prefill+decode steps were padded: extra tokens in one padding row, every row present
    assert any(tokens < pad for tokens, pad, _, _ in mixed) and any(r > 1 for *_, r in mixed)
    assert all(rows == b.R + 1 and pad >= tokens for tokens, pad, _, rows in mixed)
    # padding wrote no KV: both caches hold the same values (up to the matmuls' rounding
    # at another row count)
    torch.testing.assert_close(runner.kv_cache.tensor, plain.engine.runner.kv_cache.tensor,
                               rtol=0, atol=1e-5)
    bm = padded.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_mixed_graphs_need_graphs_and_triton_attention(tiny_llama):
    with pytest.raises(ConfigError, match="mixed_graphs=True needs CUDA graphs"):
        LLM(str(tiny_llama), device="cpu", mixed_graphs=True)
    assert not LLM(str(tiny_llama), device="cpu").engine.config.mixed_graphs


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_gpu_mixed_steps_replay_graphs_and_equal_eager(tiny_llama, fp8):
    opts = dict(CHUNKED, device="cuda", kv_cache_dtype="fp8" if fp8 else "auto")
    eager = _generate(LLM(str(tiny_llama), enforce_eager=True, **opts))
    llm = LLM(str(tiny_llama), mixed_graphs=True, **opts)
    runner = llm.engine.runner
    assert llm.engine.config.mixed_graphs and runner.mixed_graphs.sizes == [32]
    replays = []
    replay = runner.mixed_graphs.replay
    runner.mixed_graphs.replay = lambda *a: replays.append(a) or replay(*a)
    _assert_same(_generate(llm), eager)
    assert replays, "no mixed step replayed a graph"
    off = LLM(str(tiny_llama), **opts)  # off by default
    assert off.engine.runner.mixed_graphs is None
    _assert_same(_generate(off), eager)
    del llm, off
    torch.cuda.empty_cache()
