"""KV beyond the device on a tiny model: preemption by swap, the host prefix cache, admission
headroom, and the step trace that records them. Outputs are held against a run that keeps
everything on the device (and, through test_tiny_models, against transformers)."""

import random

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.core.errors import ConfigError
from nanovllm.core.trace import read_trace
from nanovllm.engine.resolve import GPU_SWAP_GIB, default_swap_gib
from nanovllm.worker.host_pool import host_memory_available
from tests.support import make_prompts

TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
# 24 blocks of 4 tokens: eight prompts of ~20 tokens cannot all run to their end at once
TIGHT = dict(num_kv_blocks=24, block_size=4, max_model_len=96, max_num_seqs=8)


def run(model, prompts, **options):
    llm = LLM(str(model), **{"device": "cpu", **options})
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a device block leaked"
    if bm.host:
        assert len(bm.host.free) == bm.host.num_blocks, "a host block is still held"
    bm.check_invariants([])
    return llm, [(o.token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def test_swap_and_recompute_give_the_outputs_of_a_cache_that_never_fills(tiny_llama, tmp_path):
    prompts = make_prompts(seed=3, count=8, shared_prefix=8)
    _, roomy = run(tiny_llama, prompts, num_kv_blocks=256, block_size=4)
    trace = tmp_path / "swap.jsonl"
    swap, swapped = run(tiny_llama, prompts, **TIGHT, admission_headroom=0, swap_space=0.01,
                        preemption_mode="swap", trace=str(trace))
    recompute, recomputed = run(tiny_llama, prompts, **TIGHT, admission_headroom=0,
                                preemption_mode="recompute")
    assert swap.engine.scheduler.num_swaps > 0
    assert recompute.engine.scheduler.num_preemptions > 0
    assert recompute.engine.scheduler.num_swaps == 0
    assert [t for t, _ in swapped] == [t for t, _ in roomy] == [t for t, _ in recomputed]
    for (_, a), (_, b) in zip(swapped, roomy):  # the swapped K/V are the bytes computed
        for x, y in zip(a, b):
            assert [k for k, _ in x] == [k for k, _ in y]
            assert all(abs(p - q) < 1e-5 for (_, p), (_, q) in zip(x, y))

    header, steps = read_trace(str(trace))
    assert header["num_host_blocks"] == swap.engine.config.num_host_blocks > 0
    kinds = [p["kind"] for s in steps for p in s["preempted"]]
    assert kinds and set(kinds) == {"swap"}
    events = swap.engine.block_manager.events
    assert sum(s["blocks"]["swapped_out"] for s in steps) == events["swapped_out"] > 0
    assert sum(s["blocks"]["swapped_in"] for s in steps) == events["swapped_in"] > 0


def test_an_evicted_prefix_comes_back_from_host_memory(tiny_llama, tmp_path):
    rng = random.Random(5)
    first, other = ([rng.randrange(3, 400) for _ in range(41)] for _ in range(2))
    trace = tmp_path / "offload.jsonl"
    # 16 blocks of 4: the second prompt's blocks push the first one's out of the device
    llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=16, block_size=4,
              cpu_offload_gib=0.01, trace=str(trace))
    plain = LLM(str(tiny_llama), device="cpu", num_kv_blocks=16, block_size=4)
    for engine in (llm, plain):
        engine.generate([first], PARAMS, use_tqdm=False)
        engine.generate([other], PARAMS, use_tqdm=False)
    again = llm.generate([first], PARAMS, use_tqdm=False)[0]
    recomputed = plain.generate([first], PARAMS, use_tqdm=False)[0]
    bm = llm.engine.block_manager
    hits = bm.events["hit_host"]
    assert bm.events["offloaded"] > 0 and hits > 0
    # the blocks that stayed on the device, and those that came back: the whole prompt but
    # its last token (left to compute for the logits)
    assert hits + bm.events["hit_device"] == (len(first) - 1) // 4
    assert plain.engine.block_manager.events["hit_host"] == 0
    assert again.token_ids == recomputed.token_ids
    assert again.num_cached_tokens == len(first) - 1
    assert recomputed.num_cached_tokens < again.num_cached_tokens
    _, steps = read_trace(str(trace))
    assert sum(s["blocks"]["hit_host"] for s in steps) == bm.events["hit_host"]
    assert max(s["kv"]["host"]["cached"] for s in steps) > 0


def test_admission_headroom_queues_a_burst_instead_of_preempting(tiny_llama):
    prompts = make_prompts(seed=3, count=8, shared_prefix=8)
    eager, eager_out = run(tiny_llama, prompts, **TIGHT, admission_headroom=0)
    queued, queued_out = run(tiny_llama, prompts, **TIGHT)  # the default headroom
    assert eager.engine.scheduler.num_preemptions > 0
    assert queued.engine.scheduler.num_preemptions == 0
    assert [t for t, _ in queued_out] == [t for t, _ in eager_out]


def test_the_trace_records_every_step_row_arrival_and_finish(tiny_llama, tmp_path):
    prompts = make_prompts(seed=9, count=5, shared_prefix=6)
    path = tmp_path / "run.jsonl"
    llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16, max_num_seqs=4, trace=str(path))
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    engine = llm.engine
    header, steps = read_trace(str(path))
    assert header["num_kv_blocks"] == 64 and header["config"]["max_num_seqs"] == 4
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert all(b["t"] >= a["t"] for a, b in zip(steps, steps[1:]))
    rows = [r for s in steps for r in s["rows"]]
    prefill = sum(r["tokens"] for r in rows if r["kind"] == "prefill")
    decode = sum(r["tokens"] for r in rows if r["kind"] == "decode")
    assert (prefill, decode) == (engine.num_prefill_tokens, engine.num_decode_tokens)
    assert max(s["rows"] and sum(r["tokens"] for r in s["rows"]) for s in steps) <= 16
    arrived = {(a["req"], a["prompt_tokens"]) for s in steps for a in s["arrived"]}
    assert arrived == {(o.request_id, o.num_prompt_tokens) for o in outs}
    finished = [f for s in steps for f in s["finished"]]
    assert sorted(f["req"] for f in finished) == sorted(o.request_id for o in outs)
    assert {f["reason"] for f in finished} == {"length"}
    assert all(f["output_tokens"] == TOKENS for f in finished)
    assert all(sum(s["kv"]["device"].values()) == 64 for s in steps)
    assert steps[-1]["kv"]["device"]["used"] > 0 == steps[-1]["running"]  # the last rows
    hits = sum(s["blocks"]["hit_device"] for s in steps)
    assert hits == engine.block_manager.events["hit_device"] > 0  # the shared prefix


@pytest.mark.parametrize("options, says", [
    (dict(swap_space=-1), "swap_space"),
    (dict(preemption_mode="swap", swap_space=0), "swap_space > 0"),
    (dict(preemption_mode="evict"), "auto, swap, recompute"),
    (dict(cpu_offload_gib=1, enable_prefix_caching=False), "enable_prefix_caching=True"),
    (dict(admission_headroom=-1), "admission_headroom"),
])
def test_bad_tier_settings_say_what_to_change(tiny_llama, options, says):
    with pytest.raises(ConfigError, match=says.replace("+", r"\+")):
        LLM(str(tiny_llama), device="cpu", **options)


def test_a_host_tier_beyond_the_hosts_memory_says_what_to_lower(tiny_llama):
    available = host_memory_available()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    with pytest.raises(ConfigError, match="lower swap_space or cpu_offload_gib"):
        LLM(str(tiny_llama), device="cpu", swap_space=0.5 * available / 2**30,
            cpu_offload_gib=0.5 * available / 2**30)


def test_the_default_swap_space_leaves_a_small_host_room():
    gib = 2**30
    assert default_swap_gib(64 * gib) == GPU_SWAP_GIB == 4.0
    assert default_swap_gib(8 * gib) == 2.0  # a quarter of what the host has available
    assert default_swap_gib(None) == GPU_SWAP_GIB  # no /proc/meminfo


def test_swap_and_offload_copy_the_right_bytes(tiny_llama, device):
    """The outputs of a cache that swaps and offloads equal those of one that never fills;
    on CUDA the copies run on a side stream through pinned memory."""
    prompts = make_prompts(seed=3, count=8, shared_prefix=8)
    _, roomy = run(tiny_llama, prompts, device=device, dtype="float32", num_kv_blocks=256,
                   block_size=4)
    for options in (dict(admission_headroom=0, swap_space=0.01, preemption_mode="swap"),
                    dict(admission_headroom=0, swap_space=0, cpu_offload_gib=0.01)):
        llm, outs = run(tiny_llama, prompts, device=device, dtype="float32", **TIGHT,
                        **options)
        assert llm.engine.scheduler.num_preemptions > 0
        assert [t for t, _ in outs] == [t for t, _ in roomy], options
