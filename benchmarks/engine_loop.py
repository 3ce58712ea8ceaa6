"""The server's engine process without HTTP, against LLM.generate on the same requests.

    python benchmarks/engine_loop.py --model PATH --num-prompts 1024 --input-len 512 \
        --output-len 256 --max-num-seqs 256 --device cuda

`benchmarks/serve.py` compares the whole server with offline generation; this splits off
the HTTP front end: the requests go straight down the engine process's pipe (as the front
end sends them, streamed) and a plain loop reads the Deltas back. If this is already
slower than offline, the gap is in the engine process, not in HTTP. Each side runs twice,
alternating (engine, offline, engine, offline), so that neither gains from running second
(warm kernel caches, a cooler host); lengths vary by +-50% around the given ones, and
every request ignores EOS, so both sides generate the same number of tokens.
"""

import argparse
import gc
import random
import threading
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.engine_proc import AddRequest, start_engine


def make_requests(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    lo_in, hi_in = args.input_len // 2, args.input_len * 3 // 2
    lo_out, hi_out = args.output_len // 2, args.output_len * 3 // 2
    return [
        ([rng.randrange(1, args.vocab_limit) for _ in range(rng.randint(lo_in, hi_in))],
         rng.randint(lo_out, hi_out))
        for _ in range(args.num_prompts)
    ]  # fmt: skip


def params(n: int, temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n)


def run_engine_proc(args, kwargs: dict, reqs) -> float:
    proc, conn = start_engine(args.model, kwargs, None)
    try:
        kind, info = conn.recv()
        assert kind == "ready", info
        for warm in (True, False):  # a short pass first, as serve.py's warm-up

            def send_all(warm=warm):  # from a thread, as the front end reads while it sends
                for i, (ids, n) in enumerate(reqs):
                    p = params(4 if warm else n, args.temperature)
                    conn.send(("add", AddRequest(f"{'w' if warm else 'r'}{i}", ids, p)))

            start = time.perf_counter()
            sender = threading.Thread(target=send_all)
            sender.start()
            left, tokens = len(reqs), 0
            while left:
                msg = conn.recv()
                if msg[0] == "out":
                    for d in msg[1]:
                        tokens += len(d.token_ids)
                        left -= d.finish_reason is not None
            elapsed = time.perf_counter() - start
            sender.join()
        conn.send(("shutdown",))
        proc.join(30)
        return tokens / elapsed
    finally:
        if proc.is_alive():
            proc.kill()


def run_offline(args, kwargs: dict, reqs) -> float:
    llm = LLM(args.model, **kwargs)
    prompts = [ids for ids, _ in reqs]
    llm.generate(prompts, params(4, args.temperature), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, [params(n, args.temperature) for _, n in reqs], use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    del llm, outs
    gc.collect()  # the next engine sizes its KV cache from free memory: give it all back
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--vocab-limit", type=int, default=32000, help="prompt ids are below it")
    ap.add_argument("--admission-batch", type=int, default=1, help="engine option (both sides)")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads per engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    kwargs = dict(device=args.device, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len, admission_batch=args.admission_batch,
                  num_threads=args.threads)
    reqs = make_requests(args)
    print(f"{len(reqs)} requests, {sum(len(i) for i, _ in reqs):,} prompt tokens, "
          f"{sum(n for _, n in reqs):,} output tokens; engine {kwargs}")
    results: dict[str, list[float]] = {"engine process": [], "LLM.generate": []}
    for r in range(args.rounds):
        for name, fn in (("engine process", run_engine_proc), ("LLM.generate", run_offline)):
            results[name].append(fn(args, kwargs, reqs))
            print(f"round {r + 1}: {name:<15} {results[name][-1]:10,.1f} output tok/s", flush=True)
    best = {k: max(v) for k, v in results.items()}
    print(f"best: engine process {best['engine process']:,.1f}, LLM.generate "
          f"{best['LLM.generate']:,.1f} tok/s; ratio "
          f"{best['engine process'] / best['LLM.generate']:.3f}")


if __name__ == "__main__":
    main()
