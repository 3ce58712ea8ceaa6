"""What keeping the default model's GGUF weights packed costs in accuracy, against the dense
float32 path and transformers (which dequantizes the same file to float32).

    python -m benchmarks.quant_accuracy [--max-tokens 48] [--prompts 16]

For each held-out chat prompt (none of them is used by the speed benchmarks), the dense
engine's greedy continuation is the text scored: every engine computes its next-token
distribution at each position of prompt + continuation in one teacher-forced pass, and
KL(transformers float32 || engine) is averaged over the continuation's positions. Greedy
agreement runs each engine freely: the share of prompts whose whole continuation equals the
dense one, and the mean length of the common prefix.
"""

import argparse
import json
import time

import torch

HELD_OUT = [
    "What is the tallest mountain in the world?", "Write a short poem about autumn leaves.",
    "Name three programming languages.", "How many days are in a leap year?",
    "Explain gravity in one sentence.", "Give me an antonym for cold.",
    "What is 7 plus 15?", "Who wrote Romeo and Juliet?", "What do bees make?",
    "Suggest a name for a small bakery.", "Why do leaves change color in the fall?",
    "Describe a dog in five words.", "What is the freezing point of water in Fahrenheit?",
    "Tell me a fun fact about penguins.", "How does a rainbow form?",
    "What is the smallest prime number?",
]  # fmt: skip


def kl(ref: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    return (ref.exp() * (ref - ours)).sum(-1)


def agreement(chats, base, mine, references, ours) -> dict:
    """An engine's figures against a reference: KL(reference || engine) over the positions
    of each chat's base continuation (`references[i]` and `ours(ids)`: log next-token
    distributions of chat i + base[i], teacher-forced), and how far the engine's own greedy
    continuations `mine` agree with `base`."""
    kls, same, prefix = [], 0, 0
    for chat, ref, want, got in zip(chats, references, base, mine):
        steps = slice(len(chat) - 1, len(chat) + len(want) - 1)  # the continuation's
        with torch.no_grad():
            kls.append(kl(ref[steps], ours(chat + want)[steps]))
        same += got == want
        prefix += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    k = torch.cat(kls)
    return {
        "mean_kl": float(k.mean()), "p99_kl": float(k.quantile(0.99)),
        "max_kl": float(k.max()), "same_continuation": f"{same}/{len(chats)}",
        "mean_common_prefix": prefix / len(chats),
    }


def report(figures: dict[str, dict], label: str, width: int, args, extra=None) -> None:
    """The agreement table, one row per engine (`extra`: (heading, key, format) of a last
    column), and with --out the figures as JSON."""
    head = (f"{label:{width}s} {'mean KL':>10s} {'p99 KL':>10s} {'max KL':>10s} "
            f"{'same text':>10s} {'common prefix':>14s}")
    print(head + (f" {extra[0]:>15s}" if extra else ""))
    for name, f in figures.items():
        row = (f"{name:{width}s} {f['mean_kl']:10.2e} {f['p99_kl']:10.2e} {f['max_kl']:10.2e} "
               f"{f['same_continuation']:>10s} {f['mean_common_prefix']:14.1f}")
        print(row + (f" {f[extra[1]]:{extra[2]}}" if extra else ""))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"figures": figures, "date": time.strftime("%Y-%m-%d"),
                       "max_tokens": args.max_tokens}, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT))
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()

    from nanovllm import LLM, SamplingParams
    from nanovllm.model.loader.source import default_model_path
    from tests.support import engine_logprobs as score
    from tests.support import load_hf_model

    path = default_model_path()
    hf = load_hf_model(path.parent, gguf_file=path.name)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {fmt: LLM(weight_format=fmt, max_num_seqs=16, max_model_len=1024)
               for fmt in ("dense", "int4", "int4-bf16")}
    chats = [engines["dense"].engine.render_chat([{"role": "user", "content": q}])
             for q in HELD_OUT[: args.prompts]]
    outs = {fmt: [o.token_ids for o in llm.generate(chats, sp, use_tqdm=False)]
            for fmt, llm in engines.items()}
    with torch.no_grad():
        references = [torch.log_softmax(hf(torch.tensor([c + d])).logits[0].double(), -1)
                      for c, d in zip(chats, outs["dense"])]
    figures = {fmt: agreement(chats, outs["dense"], outs[fmt], references,
                              lambda ids, llm=llm: score(llm, ids))
               for fmt, llm in engines.items()}
    print(f"{len(chats)} held-out chat prompts, {args.max_tokens} greedy tokens each; "
          "KL(transformers float32 || engine) per token, nats")
    report(figures, "weights", 8, args)


if __name__ == "__main__":
    main()
