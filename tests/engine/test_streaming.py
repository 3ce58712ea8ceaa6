"""Streamed outputs, whole and as deltas, against the offline result of the same requests."""

import pytest

from nanovllm import LLM, SamplingParams


@pytest.mark.parametrize("extra", [
    dict(overlap=False),
    dict(overlap=True),
    # chunked prefill, and a KV cache too small for every running row: preemption while
    # streaming recomputes a sequence, and must neither repeat nor lose what was sent
    dict(overlap=True, max_num_batched_tokens=6, num_kv_blocks=9, admission_headroom=0),
], ids=["plain", "overlap", "overlap+preempt"])
def test_streamed_outputs_show_only_tokens_on_the_host(tiny_llama, extra):
    """Streaming, cumulative and delta, against the offline result of the same requests:
    with overlap a step's sampled token is still a placeholder when the step reports, and
    outputs must not show it. Delta outputs add up to the whole completion, with one
    logprobs entry per token, and never show a stop string's prefix that is later cut."""
    from nanovllm.engine.llm_engine import LLMEngine

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    args = dict(n=2, temperature=0.8, seed=4, max_tokens=10, ignore_eos=True, logprobs=2)
    sp = SamplingParams(**args)
    # a cache of a few blocks: the CPU default (a million of 4 tokens) takes seconds to set up
    kw = dict(device="cpu", block_size=4, max_num_seqs=3, num_kv_blocks=64) | extra
    offline = LLM(str(tiny_llama), **kw).generate(prompts, sp, use_tqdm=False)
    stop = offline[0].outputs[1].text[3:6]
    stopped = LLM(str(tiny_llama), **kw).generate(
        [prompts[0]], SamplingParams(**args, stop=[stop]), use_tqdm=False)[0]
    engine = LLMEngine(str(tiny_llama), **kw)
    for i, p in enumerate(prompts):
        engine.add_request(p, sp, f"cum{i}", stream=True)
        engine.add_request(p, sp, f"delta{i}", stream=True, delta=True)
    engine.add_request(prompts[0], SamplingParams(**args, stop=[stop]), "stop",
                       stream=True, delta=True)
    engine.add_request(prompts[1], sp, "ids", stream=True, delta=True, detokenize=False)
    seen: dict[tuple[str, int], dict] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                assert -1 not in o.token_ids
                s = seen.setdefault((out.request_id, o.index), {"ids": [], "text": "", "lps": 0})
                if out.request_id.startswith("cum"):
                    assert o.token_ids[: len(s["ids"])] == s["ids"]  # grows, never rewritten
                    s["ids"], s["text"], s["lps"] = o.token_ids, o.text, len(o.logprobs)
                else:
                    s["ids"] = s["ids"] + o.token_ids
                    s["text"] += o.text
                    s["lps"] += len(o.logprobs)
                    assert len(o.logprobs) == len(o.token_ids)
                    if out.request_id == "stop":  # what was shown stays in the final text
                        assert stopped.outputs[o.index].text.startswith(s["text"])
                s["reason"] = o.finish_reason
    for i, ref in enumerate(offline):
        for o in ref.outputs:
            for kind in ("cum", "delta"):
                s = seen[(f"{kind}{i}", o.index)]
                assert (s["ids"], s["text"], s["reason"]) == (o.token_ids, o.text, "length")
                assert s["lps"] == len(o.token_ids)
    for o in stopped.outputs:
        s = seen[("stop", o.index)]
        assert (s["ids"], s["text"], s["reason"]) == (o.token_ids, o.text, o.finish_reason)
    for o in offline[1].outputs:
        s = seen[("ids", o.index)]
        assert s["ids"] == o.token_ids and s["text"] == ""
    if "admission_headroom" in extra:
        assert engine.scheduler.num_preemptions > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_delta_rows_are_the_delta_outputs(tiny_llama, overlap):
    """step_delta_rows (the server's engine process) reports exactly what step() reports
    for the same delta requests, field for field, as rows of Delta's fields, and the ids of
    requests as they finish: streamed and not, n = 2, logprobs, a stop string, no text."""
    from nanovllm.engine.llm_engine import LLMEngine

    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    args = dict(n=2, temperature=0.8, seed=4, max_tokens=9, ignore_eos=True, logprobs=1)
    kw = dict(device="cpu", block_size=4, max_num_seqs=3, num_kv_blocks=64, overlap=overlap)

    def run(rows: bool) -> tuple[list, list]:
        engine = LLMEngine(str(tiny_llama), **kw)
        stop = SamplingParams(**args, stop=["a", "e"])
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(**args), f"s{i}", stream=True, delta=True)
            engine.add_request(p, stop, f"t{i}", stream=True, delta=True)
            engine.add_request(p, SamplingParams(**args), f"f{i}", stream=False, delta=True,
                               detokenize=i == 0)
        steps, finished = [], []
        while engine.has_unfinished_requests():
            if rows:
                got, done = engine.step_delta_rows()
            else:
                outs = engine.step()
                got = [(out.request_id, o.index, o.text, o.token_ids, o.logprobs,
                        o.finish_reason, o.stop_reason, out.num_cached_tokens)
                       for out in outs for o in out.outputs]
                done = [out.request_id for out in outs if out.finished]
            steps.append([row[:8] for row in got])  # queue_time: a clock reading
            finished.append(done)
        assert not engine.requests and not engine._owner
        return steps, finished

    by_outputs, by_rows = run(False), run(True)
    assert by_rows == by_outputs
    assert sum(len(d) for d in by_rows[1]) == 9
    assert any(row[6] is not None for step in by_rows[0] for row in step)  # a stop string
