"""CPU figures for the default model: start-up to first token, and batch throughput vs transformers.

    python -m benchmarks.cpu                 # both
    python -m benchmarks.cpu --skip-hf       # ours only

Start-up is the wall time from launching `nanovllm generate` to its first byte of output.
Throughput is 16 chat prompts (workloads.CHAT_QUESTIONS) through `LLM.generate` and through
transformers' `generate` (one left-padded batch), greedy, same max_tokens; output tokens count
up to and including EOS, never padding.
"""

import argparse
import os
import platform
import subprocess
import sys
import time

from benchmarks.workloads import CHAT_QUESTIONS


def startup() -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm", "generate", "What is the capital of France?",
         "--max-tokens", "16"],
        stdout=subprocess.PIPE,
    )
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.communicate()
    return first


def ours(max_tokens: int) -> tuple[float, int, list[list[int]]]:
    from nanovllm import LLM, SamplingParams

    llm = LLM()
    prompts = [llm.engine.render_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outs), prompts


def transformers_generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    from nanovllm.model.loader.source import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    pad, eos = 2, 2
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
    tokens = 0
    for row in out[:, width:].tolist():
        tokens += row.index(eos) + 1 if eos in row else len(row)
    return elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    import torch

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"start-up to first token (nanovllm generate): {startup():.1f} s")
    t, n, prompts = ours(args.max_tokens)
    print(f"nano-vLLM LLM.generate, 16 chat prompts: {n} tokens in {t:.1f} s = {n / t:.1f} tok/s")
    if not args.skip_hf:
        t_hf, n_hf = transformers_generate(prompts, args.max_tokens)
        print(f"transformers generate, same prompts:   {n_hf} tokens in {t_hf:.1f} s = "
              f"{n_hf / t_hf:.1f} tok/s")
        print(f"speed-up: {(n / t) / (n_hf / t_hf):.2f}x")


if __name__ == "__main__":
    main()
