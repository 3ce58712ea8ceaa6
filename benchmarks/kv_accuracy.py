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

`--fresh-prefill` adds the fp8 token engine with kernels.FRESH_PREFILL: its prefills read
their own positions' K/V unrounded, so a teacher-forced prefill would not see its cache. It
is scored as generation meets it instead: the prompt in one prefill, then each continuation
token in a decode step of its own (tests.support.engine_logprobs with `prefill`), which
read the cache; rows "[decode
steps]" score the reference, the fp8 token engine and it that way.

`--fp8-attention` adds the fp8 token engine with `fp8_attention` "q" and "qp": attention on
the fp8 tensor cores, with q (and P) in e4m3 (kernels/triton_fp8_decode.py; on the CPU the
torch backend computes the same numerics, `torch_attention.fp8_decode_reference`).
"""

import argparse

import torch

from benchmarks.quant_accuracy import HELD_OUT, agreement, report

ENGINES = {  # name -> engine options beside the shared ones
    "float32": dict(dtype="float32"),
    "bf16 cache": dict(dtype="bfloat16"),
    "fp8 token": dict(dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_scales="token"),
    "fp8 tensor": dict(dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_scales="tensor"),
}
REFERENCE = "bf16 cache"
FRESH = "fp8 token, fresh prefill"


def main() -> None:
    import nanovllm.kernels

    # the one teacher-forced pass is a prefill: with kernels.FRESH_PREFILL its positions
    # would read their K/V unrounded and the figures would say nothing of the cache
    nanovllm.kernels.FRESH_PREFILL = False
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT))
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--fresh-prefill", action="store_true",
                    help=f"also the engine '{FRESH}' (kernels.FRESH_PREFILL), scored by "
                         "decode steps")
    ap.add_argument("--fp8-attention", action="store_true",
                    help="also the fp8 decode kernel's numerics (q, and q and P, in e4m3)")
    args = ap.parse_args()
    engine_opts = dict(ENGINES)
    if args.fp8_attention:
        for mode in ("q", "qp"):
            engine_opts[f"fp8 token, fp8_attention={mode}"] = dict(ENGINES["fp8 token"],
                                                                   fp8_attention=mode)

    from nanovllm import LLM, SamplingParams
    from nanovllm.worker.kv_cache import kv_bytes_per_token
    from tests.support import engine_logprobs as score

    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    shared = dict(device="cpu", weight_format="dense", max_num_seqs=16, max_model_len=1024,
                  kv_cache_gib=0.25)
    engines = {name: LLM(**shared, **opts) for name, opts in engine_opts.items()}
    if args.fresh_prefill:  # the engine reads the switch as it picks its kernels
        nanovllm.kernels.FRESH_PREFILL = True
        engines[FRESH] = LLM(**shared, **ENGINES["fp8 token"])
        nanovllm.kernels.FRESH_PREFILL = False
        assert engines[FRESH].engine.runner.kernels.fresh_prefill
    ref = engines[REFERENCE]
    chats = [ref.engine.render_chat([{"role": "user", "content": q}])
             for q in HELD_OUT[: args.prompts]]
    outs = {name: [o.token_ids for o in llm.generate(chats, sp, use_tqdm=False)]
            for name, llm in engines.items()}
    base = outs[REFERENCE]
    with torch.no_grad():  # the reference's distributions, once
        references = [score(ref, c + b) for c, b in zip(chats, base)]
    figures: dict[str, dict] = {}
    for name, llm in engines.items():
        if name != FRESH:  # (its prefill would not read its cache)
            figures[name] = agreement(chats, base, outs[name], references,
                                      lambda ids, llm=llm: score(llm, ids))
    if args.fresh_prefill:  # the cache's engines and the fresh one, all scored by decode
        # steps, the reference too: a bf16 decode step and a prefill round differently, so
        # mixing the two ways would measure that
        def decoded(llm, ids):
            chat = next(c for c in chats if ids[:len(c)] == c)  # where the continuation starts
            return score(llm, ids, prefill=len(chat))

        references = [decoded(ref, c + b) for c, b in zip(chats, base)]
        for name in (REFERENCE, "fp8 token", FRESH):
            figures[f"{name} [decode steps]"] = agreement(
                chats, base, outs[name], references,
                lambda ids, llm=engines[name]: decoded(llm, ids))
    for name, f in figures.items():
        runner = engines[name.removesuffix(" [decode steps]")].engine.runner
        f["kv_bytes_per_token"] = kv_bytes_per_token(runner.model_config, runner.kv_format)
    print(f"{len(chats)} held-out chat prompts, {args.max_tokens} greedy tokens each; "
          f"KL({REFERENCE} || engine) per token, nats; default model, bfloat16 on the CPU")
    report(figures, "KV cache", max(map(len, figures)), args,
           ("KV bytes/token", "kv_bytes_per_token", "15,d"))


if __name__ == "__main__":
    main()
