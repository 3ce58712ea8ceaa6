"""Start-up steps over dummy sequences leave the engine as they found it."""

from nanovllm import LLM, SamplingParams
from nanovllm.worker.warmup import warm_up_kernels


def test_kernel_warmup_leaves_the_engine_clean(tiny_llama):
    # on GPU it runs at start-up; here it runs the same steps through the torch backend
    # a long step budget with a short max_model_len: warm-up positions must stay inside
    # the RoPE table; 64 blocks hold every warm-up step (it stops at one that would not fit)
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=2048, max_model_len=64)
    warm_up_kernels(llm.engine.runner)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 3
