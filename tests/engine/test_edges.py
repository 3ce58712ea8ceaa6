"""Edges of a request's life, end to end on the tiny models: a context limit that is not a
multiple of the block size (the last token lands in a part-filled block), and a request
aborted mid-generation while a step is in flight (overlap)."""

import functools

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.engine.llm_engine import LLMEngine
from tests.support import hf_greedy, make_prompts

MAX_MODEL_LEN = 37  # 2 blocks of 16 and 5 tokens of a third
BLOCK_SIZE = 16


@functools.cache
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_to_end(engine: LLMEngine, max_steps: int = 200) -> dict:
    """request id -> final output; a scheduler that never finishes a sequence fails here
    instead of hanging the suite."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    raise AssertionError(f"unfinished after {max_steps} steps: {list(engine.requests)}")


def _context_limit(path, device: str, **options) -> None:
    engine = LLMEngine(str(path), device=device, max_model_len=MAX_MODEL_LEN,
                       block_size=BLOCK_SIZE, num_kv_blocks=16, **options)
    full = [(i * 7) % 390 + 3 for i in range(MAX_MODEL_LEN - 1)]  # one short of the limit
    short = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    fill = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    engine.add_request(full, fill, "full")
    engine.add_request(short, fill, "short")
    outs = run_to_end(engine)
    hf = _hf_model(str(path))
    assert outs["full"].token_ids == hf_greedy(hf, full, 1), "exactly one token fits"
    assert outs["short"].token_ids == hf_greedy(hf, short, MAX_MODEL_LEN - len(short))
    assert [outs[r].finish_reason for r in ("full", "short")] == ["length", "length"]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("options", [
    dict(),
    dict(overlap=True),  # the last placeholder must not be scheduled past the limit
    dict(overlap=True, max_num_batched_tokens=8, max_num_seqs=4),  # chunked prefill
], ids=["plain", "overlap", "overlap+chunked"])
def test_context_limit_off_the_block_grid(tiny_llama, options):
    """max_model_len=37 with blocks of 16: a prompt of 36 tokens gets exactly one token and
    finish reason `length`; `max_tokens=None` fills the context to exactly 37 tokens, the
    tokens transformers picks."""
    _context_limit(tiny_llama, "cpu", **options)


@pytest.mark.gpu
def test_context_limit_off_the_block_grid_gpu(tiny_llama):
    """The same on CUDA: Triton attention, CUDA graphs and overlap (the GPU defaults)."""
    _context_limit(tiny_llama, "cuda", dtype="float32")


@pytest.mark.parametrize("abort_at, decoding", [(3, False), (12, True)],
                         ids=["mid-prefill", "mid-decode"])
def test_abort_mid_generation_with_overlap(tiny_llama, abort_at, decoding):
    """Aborting running requests while a step that holds them is in flight: every other
    request still gets exactly its solo greedy tokens, the aborted ones end with reason
    `abort` and a prefix of theirs, and every KV block comes back."""
    engine = LLMEngine(str(tiny_llama), device="cpu", overlap=True, block_size=4,
                       num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=8)
    prompts = make_prompts(seed=8, count=5)
    max_tokens = 10
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, sp, str(i), stream=True, delta=True)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    reasons: dict[str, str] = {}
    aborted = ("1", "3")
    steps = 0
    while engine.has_unfinished_requests():
        assert steps < 200, "requests never finished"
        for out in engine.step():
            got[out.request_id] += out.outputs[0].token_ids
            reasons[out.request_id] = out.outputs[0].finish_reason
        steps += 1
        if steps == abort_at:
            assert engine._inflight is not None, "abort while a step is in flight"
            for rid in aborted:
                final = engine.finish_request(rid).outputs[0]  # a delta: what is new
                got[rid] += final.token_ids
                reasons[rid] = final.finish_reason
    hf = _hf_model(str(tiny_llama))
    for i, p in enumerate(prompts):
        rid, ref = str(i), hf_greedy(hf, p, max_tokens)
        if rid in aborted:
            assert reasons[rid] == "abort" and len(got[rid]) < max_tokens
            assert bool(got[rid]) == decoding, f"request {rid} had {len(got[rid])} tokens"
            assert got[rid] == ref[: len(got[rid])], f"aborted request {rid}"
        else:
            assert (got[rid], reasons[rid]) == (ref, "length"), f"survivor {rid}"
    assert not engine.requests and not engine.scheduler.running
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "an aborted request kept KV blocks"
