"""The server's engine process without HTTP, against LLM.generate on the same requests.

    python -m benchmarks.engine_loop --model PATH --num-prompts 1024 --input-len 512 \
        --output-len 256 --max-num-seqs 256 --device cuda

`benchmarks.serve` compares the whole server with offline generation; this splits off
the HTTP front end: the requests go straight down the engine process's pipe (as the front
end sends them, streamed) and a plain loop reads the Deltas back. If this is already
slower than offline, the gap is in the engine process, not in HTTP. Each side runs twice,
alternating (engine, offline, engine, offline), so that neither gains from running second
(warm kernel caches, a cooler host); lengths vary by +-50% around the given ones, and
every request ignores EOS, so both sides generate the same number of tokens.
"""

import argparse
import gc
import threading
import time
from pathlib import Path

import torch

from benchmarks.workloads import random_requests
from nanovllm import LLM, SamplingParams
from nanovllm.core.config import EngineConfig
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.engine_proc import start_engine
from nanovllm.engine.messages import AddRequest, EngineProcessConfig, Outputs, Ready, Shutdown
from nanovllm.engine.tokenizer import Tokenizer


def make_requests(args, seed: int) -> list[tuple[list[int], int]]:
    """Lengths +-50% (rounded down) around --input-len and --output-len, ids below --vocab-limit."""
    n_in, n_out = args.input_len, args.output_len
    return random_requests(args.num_prompts, (n_in // 2, n_in * 3 // 2),
                           (n_out // 2, n_out * 3 // 2), (1, args.vocab_limit - 1), seed,
                           output_len_first=False)


def params(n: int, temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n)


def run_engine_proc(args, kwargs: dict, warm_reqs, reqs, stream: bool = True) -> float:
    proc, (conn,) = start_engine(EngineProcessConfig(args.model, EngineConfig(**kwargs), None))
    tok = Tokenizer.from_pretrained_dir(Path(args.model))
    try:
        ready = conn.recv()
        assert isinstance(ready, Ready), ready
        for warm, batch in ((True, warm_reqs), (False, reqs)):  # as serve.py's warm-up

            def send_all(warm=warm, batch=batch):  # from a thread, as the front end does
                for i, (ids, n) in enumerate(batch):
                    p = params(4 if warm else n, args.temperature)
                    rid = f"{'w' if warm else 'r'}{i}"
                    # as the front end sends a stream without stop strings: it decodes
                    conn.send(AddRequest(rid, ids, p, stream=stream, detokenize=False))

            start = time.perf_counter()
            sender = threading.Thread(target=send_all)
            sender.start()
            left, tokens = len(batch), 0
            detoks: dict[str, IncrementalDetokenizer] = {}
            while left:
                msg = conn.recv()
                if isinstance(msg, Outputs):
                    for d in msg.deltas:
                        detok = detoks.get(d.request_id)
                        if detok is None:
                            detok = detoks[d.request_id] = IncrementalDetokenizer(tok)
                        detok.step(d.token_ids)
                        tokens += len(d.token_ids)
                        left -= d.finish_reason is not None
            elapsed = time.perf_counter() - start
            sender.join()
        conn.send(Shutdown())
        proc.join(30)
        return tokens / elapsed
    finally:
        if proc.is_alive():
            proc.kill()


def run_offline(args, kwargs: dict, warm_reqs, reqs) -> float:
    llm = LLM(args.model, **kwargs)
    warm = [ids for ids, _ in warm_reqs]
    llm.generate(warm, params(4, args.temperature), use_tqdm=False)
    prompts = [ids for ids, _ in reqs]
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
    ap.add_argument("--admission-batch", type=int, default=None,
                    help="engine option (both sides; default: the engine's)")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads per engine")
    ap.add_argument("--modes", default="stream,offline",
                    help="what each round runs, in order: stream (the engine process, as the "
                    "server uses it), final (the engine process, one Delta per completion at "
                    "its end: no per-step streaming work), offline (LLM.generate)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    kwargs = dict(device=args.device, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len, admission_batch=args.admission_batch,
                  num_threads=args.threads)
    # the warm-up has prompts of its own, so the timed run is not served from the prefix
    # cache it filled (until commit cb31c83 both sides warmed up on the timed prompts)
    warm, reqs = make_requests(args, args.seed + 1), make_requests(args, args.seed)
    print(f"{len(reqs)} requests, {sum(len(i) for i, _ in reqs):,} prompt tokens, "
          f"{sum(n for _, n in reqs):,} output tokens; engine {kwargs}")
    modes = {
        "stream": ("engine process", lambda: run_engine_proc(args, kwargs, warm, reqs)),
        "final": ("engine, no stream", lambda: run_engine_proc(args, kwargs, warm, reqs, False)),
        "offline": ("LLM.generate", lambda: run_offline(args, kwargs, warm, reqs)),
    }
    chosen = [modes[m.strip()] for m in args.modes.split(",")]
    results: dict[str, list[float]] = {name: [] for name, _ in chosen}
    for r in range(args.rounds):
        for name, fn in chosen:
            results[name].append(fn())
            print(f"round {r + 1}: {name:<17} {results[name][-1]:10,.1f} output tok/s", flush=True)
    best = {k: max(v) for k, v in results.items()}
    base = best.get("LLM.generate")
    print("best: " + ", ".join(
        f"{k} {v:,.1f} tok/s" + (f" ({v / base:.3f} of offline)" if base and k != "LLM.generate"
                                 else "") for k, v in best.items()))


if __name__ == "__main__":
    main()
