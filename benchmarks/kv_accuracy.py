"""What an fp8 KV cache costs in accuracy against the bf16 cache, on the default model.

    python -m benchmarks.kv_accuracy [--max-tokens 64] [--prompts 16]

Every engine runs the default model in bfloat16 with dense weights on the CPU (the torch
attention backend, the fp8 cache's reference); only the KV cache differs: bf16 (the model's
dtype) or fp8 (e4m3 with a scale per token and head). A float32 engine gives the noise floor
of bf16 itself.

For each held-out chat prompt (benchmarks/quant_accuracy.py's, used by no speed benchmark),
the bf16-cache engine's greedy continuation is the text scored, as generation meets it: the
prompt in one prefill, then each continuation token in a decode step of its own, which reads
every earlier position from the cache (an fp8 cache's prefill reads the step's own K/V as
computed, so a single teacher-forced pass would not see the cache). KL(bf16 cache || engine)
is averaged over the continuation's positions. Greedy agreement runs each engine freely: the
share of prompts whose whole continuation equals the bf16 cache's, and the mean length of
the common prefix.
"""

import argparse

import torch

from benchmarks.quant_accuracy import HELD_OUT, agreement, report

ENGINES = {  # name -> engine options beside the shared ones
    "float32": dict(dtype="float32"),
    "bf16 cache": dict(dtype="bfloat16"),
    "fp8 cache": dict(dtype="bfloat16", kv_cache_dtype="fp8"),
}
REFERENCE = "bf16 cache"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT))
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()

    from nanovllm import LLM, SamplingParams
    from nanovllm.worker.kv_cache import kv_bytes_per_token
    from tests.support import engine_logprobs

    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    shared = dict(device="cpu", weight_format="dense", max_num_seqs=16, max_model_len=1024,
                  kv_cache_gib=0.25)
    engines = {name: LLM(**shared, **opts) for name, opts in ENGINES.items()}
    ref = engines[REFERENCE]
    chats = [ref.engine.render_chat([{"role": "user", "content": q}])
             for q in HELD_OUT[: args.prompts]]
    outs = {name: [o.token_ids for o in llm.generate(chats, sp, use_tqdm=False)]
            for name, llm in engines.items()}
    base = outs[REFERENCE]

    def score(llm, ids: list[int]) -> torch.Tensor:  # the chat in one prefill, then decodes
        chat = next(c for c in chats if ids[:len(c)] == c)
        return engine_logprobs(llm, ids, prefill=len(chat))

    with torch.no_grad():  # the reference's distributions, once
        references = [score(ref, c + b) for c, b in zip(chats, base)]
    figures: dict[str, dict] = {}
    for name, llm in engines.items():
        figures[name] = agreement(chats, base, outs[name], references,
                                  lambda ids, llm=llm: score(llm, ids))
        runner = llm.engine.runner
        figures[name]["kv_bytes_per_token"] = kv_bytes_per_token(runner.model_config,
                                                                 runner.kv_format)
    print(f"{len(chats)} held-out chat prompts, {args.max_tokens} greedy tokens each; "
          f"KL({REFERENCE} || engine) per token, nats; default model, bfloat16 on the CPU")
    report(figures, "KV cache", max(map(len, figures)), args,
           ("KV bytes/token", "kv_bytes_per_token", "15,d"))


if __name__ == "__main__":
    main()
