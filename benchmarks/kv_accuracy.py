"""What an fp8 KV cache costs in accuracy, per scaling, against the bf16 cache, on the
default model (issue 11, item 2: the scaling is chosen by these figures).

    python -m benchmarks.kv_accuracy [--max-tokens 64] [--prompts 16]

Every engine runs the default model in bfloat16 with dense weights on the CPU (the torch
attention backend, the fp8 cache's reference); only the KV cache differs: bf16 (the model's
dtype), fp8 with a scale per token and head (`--kv-cache-scales token`), fp8 with one static
scale of 1 (`tensor`). A float32 engine gives the noise floor of bf16 itself.

For each held-out chat prompt (benchmarks/quant_accuracy.py's, used by no speed benchmark),
the bf16-cache engine's greedy continuation is the text scored: each engine computes its
next-token distribution at every position of prompt + continuation in one teacher-forced
pass, which stores every K/V in its cache and reads them back; KL(bf16 cache || engine) is
averaged over the continuation's positions. Greedy agreement runs each engine freely: the
share of prompts whose whole continuation equals the bf16 cache's, and the mean length of
the common prefix.

`--fp8-attention` adds the "fp8 token" engine twice more with its attention computed in the
numerics of `fp8_attention` (kernels/triton_fp8_decode.py; in torch
`torch_attention.fp8_decode_reference`): q in e4m3, and q and P in e4m3. Applied to every
query token, the teacher-forced pass's included (the engine applies them to decode rows
only), so the figures bound what those numerics cost from above.
"""

import argparse
import contextlib

import torch

from benchmarks.quant_accuracy import HELD_OUT, agreement, report

ENGINES = {  # name -> engine options beside the shared ones
    "float32": dict(dtype="float32"),
    "bf16 cache": dict(dtype="bfloat16"),
    "fp8 token": dict(dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_scales="token"),
    "fp8 tensor": dict(dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_scales="tensor"),
}
REFERENCE = "bf16 cache"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT))
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--fp8-attention", action="store_true",
                    help="also the fp8 decode kernel's numerics (q, and q and P, in e4m3)")
    args = ap.parse_args()
    runs = {name: (name, None) for name in ENGINES}  # row -> (engine, attention numerics)
    if args.fp8_attention:
        runs |= {"fp8 token, q e4m3": ("fp8 token", "q"),
                 "fp8 token, q+P e4m3": ("fp8 token", "qp")}
    emulate = _emulated_attention()

    from nanovllm import LLM, SamplingParams
    from nanovllm.worker.kv_cache import kv_bytes_per_token
    from tests.support import engine_logprobs as score

    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    shared = dict(device="cpu", weight_format="dense", max_num_seqs=16, max_model_len=1024,
                  kv_cache_gib=0.25)
    engines = {name: LLM(**shared, **opts) for name, opts in ENGINES.items()}
    ref = engines[REFERENCE]
    chats = [ref.engine.render_chat([{"role": "user", "content": q}])
             for q in HELD_OUT[: args.prompts]]
    outs = {}
    for name, (engine, mode) in runs.items():
        with emulate(mode):
            outs[name] = [o.token_ids for o in engines[engine].generate(chats, sp,
                                                                        use_tqdm=False)]
    base = outs[REFERENCE]
    with torch.no_grad():  # the reference's distributions, once
        references = [score(ref, c + b) for c, b in zip(chats, base)]
    figures: dict[str, dict] = {}
    for name, (engine, mode) in runs.items():
        llm = engines[engine]
        runner = llm.engine.runner
        with emulate(mode):
            figures[name] = agreement(chats, base, outs[name], references,
                                      lambda ids, llm=llm: score(llm, ids))
        figures[name]["kv_bytes_per_token"] = kv_bytes_per_token(runner.model_config,
                                                                 runner.kv_format)
    print(f"{len(chats)} held-out chat prompts, {args.max_tokens} greedy tokens each; "
          f"KL({REFERENCE} || engine) per token, nats; default model, bfloat16 on the CPU")
    report(figures, "KV cache", max(map(len, figures)), args,
           ("KV bytes/token", "kv_bytes_per_token", "15,d"))


def _emulated_attention():
    """A context manager factory: `with emulate(mode)` computes the torch backend's
    attention over an fp8 cache in the fp8 decode kernel's numerics (mode "q": q in e4m3;
    "qp": q and P), or as usual (None). The torch backend's function is wrapped once, before
    any engine chooses its kernels (select_kernels caches the choice)."""
    from nanovllm.kernels import torch_attention as ta

    plain, state = ta.paged_attention, {"mode": None}

    def paged_attention(q, k_cache, v_cache, meta, scale):
        mode = state["mode"]
        if mode is None or k_cache.dtype != torch.uint8:
            return plain(q, k_cache, v_cache, meta, scale)
        return ta.fp8_decode_reference(q, k_cache, v_cache, meta, scale, fp8_p=mode == "qp",
                                      decode_only=False).to(q.dtype)

    ta.paged_attention = paged_attention

    @contextlib.contextmanager
    def emulate(mode):
        state["mode"] = mode
        try:
            yield
        finally:
            state["mode"] = None

    return emulate


if __name__ == "__main__":
    main()
