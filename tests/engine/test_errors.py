"""Bad input raises a typed error that names the value, before any work, and loses nothing."""

import json

import pytest

from nanovllm import LLM, ConfigError, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=64)


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_bad_prompts_fail_before_any_work(llm):
    bm = llm.engine.block_manager
    good = [5, 6, 7]
    for bad, words in [
        ([], "empty"),
        (list(range(3, 70)), "max_model_len"),
        ([5, 100000], "vocabulary"),
        ("", "empty"),
        ("\ud800 hi", "surrogate"),
        ([{"role": "user", "content": "\udfff"}], "surrogate"),
    ]:
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate([good, bad], GREEDY, use_tqdm=False)
        # nothing was queued, no block is held, and the next request still runs
        assert not llm.engine.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_blocks
    assert len(llm.generate([good], GREEDY, use_tqdm=False)[0].token_ids) == 4
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.generate([good, good], [GREEDY], use_tqdm=False)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    ids = [engine.add_request(list(range(3, 30)), GREEDY) for _ in range(3)]
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for request_id in ids:
        assert engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_model_path_errors(tmp_path, tiny_llama):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(tmp_path))
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(tiny_llama), device="cpu", num_kv_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(str(tiny_llama), device="cpu", max_num_sequences=3)
    with pytest.raises(ConfigError, match="scheduling_policy"):
        LLM(str(tiny_llama), device="cpu", scheduling_policy="lifo")
    with pytest.raises(ConfigError, match=r"admission_batch=9 is invalid.*\[1, max_num_seqs=8\]"):
        LLM(str(tiny_llama), device="cpu", max_num_seqs=8, admission_batch=9)
