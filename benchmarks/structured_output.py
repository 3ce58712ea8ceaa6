"""What a JSON-schema constraint costs a batch: the same prompts and the same number of
output tokens, every row constrained against none, side by side in one process.

    python -m benchmarks.structured_output              # default model; batch 1 on a CPU,
                                                        # 64 on a GPU
    python -m benchmarks.structured_output --batch 8 --rounds 5 --model DIR
    python -m benchmarks.structured_output --export-tokenizer gpu-assets/tok   # then, on a
    python -m benchmarks.structured_output --tokenizer gpu-assets/tok          # GPU machine

Each round runs the constrained batch (every row under the 30-field schema of
grammar_engines.py, strings at most 48
characters, temperature 0.7, until the schema completes or --max-tokens), then the
same prompts unconstrained with each row's max_tokens set to the length its constrained
twin reached and ignore_eos: the same tokens and steps, without the mask. Rounds alternate
which side goes first; the figure is the median of the rounds' tokens/s ratios. The
constraint is compiled (and cached) in a warm-up batch first: compilation is reported on its
own, cold (a new compiler, as the engine's first constrained request meets it) and cached.

On a device machine the default model's package (98 MB) is too large to carry;
`--tokenizer DIR` runs random weights of Qwen3-0.6B's shape (benchmarks/random_model.py)
with the default model's tokenizer, which `--export-tokenizer DIR` writes here: the mask's
cost follows the tokenizer's vocabulary, which the random model's byte tokenizer would
understate.
"""

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks.grammar_engines import schema_and_instance
from nanovllm import LLM, SamplingParams
from nanovllm.core.sampling_params import StructuredOutputsParams
from nanovllm.engine.structured_output import Grammars


def prompts(llm: LLM, n: int, schema: dict) -> list[list[int]]:
    fields = ", ".join(schema["properties"])
    topics = ["a city", "a bicycle", "a recipe", "a planet", "a song", "a tree", "a river",
              "a chess opening"]
    return [llm.engine.render_chat([{"role": "user", "content": (
        f"Describe {topics[i % len(topics)]} (variant {i}) as a JSON object with the fields "
        f"{fields}.")}]) for i in range(n)]


def export_tokenizer(out: Path) -> None:
    from nanovllm.engine.tokenizer import load_tokenizer
    from nanovllm.model.loader.source import open_model

    tok = load_tokenizer(open_model(None))
    out.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(out / "tokenizer.json"))
    eos = tok.backend.id_to_token(min(tok.eos_token_ids))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": None,
         "chat_template": tok.chat_template, "add_bos_token": False}))
    print(f"wrote {out}/tokenizer.json and tokenizer_config.json")


def random_model_with(tokenizer: Path) -> Path:
    """A random Qwen3-0.6B-shaped model directory of its own (the other benchmarks' keeps
    its byte tokenizer), with `tokenizer`'s files in it."""
    from tokenizers import Tokenizer

    from benchmarks.random_model import QWEN3_RANDOM_DIR, build_random_model
    from benchmarks.workloads import QWEN3_CONFIG

    cfg = json.loads(QWEN3_CONFIG.read_text())
    eos = json.loads((tokenizer / "tokenizer_config.json").read_text())["eos_token"]
    cfg["eos_token_id"] = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).token_to_id(eos)
    cfg.pop("bos_token_id", None)
    path, _ = build_random_model(cfg, Path(QWEN3_RANDOM_DIR + "-tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, path / name)
    return path


def _parses(c) -> bool:
    if c.finish_reason != "stop":
        return False
    json.loads(c.text)  # a completed constrained output that does not parse is a bug
    return True


def timed(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--batch", type=int, default=None, help="rows (default: 64 GPU, 1 CPU)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=800)
    ap.add_argument("--export-tokenizer", metavar="DIR",
                    help="write the default model's tokenizer files to DIR and exit")
    ap.add_argument("--tokenizer", metavar="DIR",
                    help="random Qwen3-0.6B-shaped weights with the tokenizer files in DIR")
    args = ap.parse_args()
    if args.export_tokenizer:
        return export_tokenizer(Path(args.export_tokenizer))
    if args.tokenizer:
        args.model = str(random_model_with(Path(args.tokenizer)))
    gpu = torch.cuda.is_available()
    batch_size = args.batch or (64 if gpu else 1)
    # no prefix caching: the side that runs second would find the prompts cached
    llm = LLM(args.model, max_num_seqs=batch_size, max_model_len=2048,
              enable_prefix_caching=False)
    schema, _ = schema_and_instance()
    for prop in schema["properties"].values():  # a small model's strings may never end
        if prop.get("type") == "string":
            prop["maxLength"] = 48
    so = StructuredOutputsParams(json=schema)

    engine = llm.engine
    grammars = Grammars(engine.tokenizer.backend.to_str(), engine.model_config.vocab_size,
                        engine.eos_token_ids)
    start = time.perf_counter()
    grammars.compile(so)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    grammars.compile(so)
    cached = time.perf_counter() - start

    batch = prompts(llm, batch_size, schema)
    constrained = SamplingParams(temperature=0.7, max_tokens=args.max_tokens, seed=1,
                                 structured_outputs=so)
    llm.generate(batch[:2], constrained, use_tqdm=False)  # warm-up; compiles into the cache
    ratios, rows = [], []
    for r in range(args.rounds):
        def run_constrained():
            return timed(llm, batch, [constrained] * len(batch))

        def run_plain(lengths):
            plain = [SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True, seed=1)
                     for n in lengths]
            return timed(llm, batch, plain)

        if r % 2 == 0:
            t_c, outs = run_constrained()
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            t_p, _ = run_plain(lengths)
        else:  # the plain side first: lengths from the previous round's constrained run
            t_p, _ = run_plain(lengths)
            t_c, outs = run_constrained()
            lengths = [len(o.outputs[0].token_ids) for o in outs]
        tokens = sum(lengths)
        valid = sum(_parses(o.outputs[0]) for o in outs)
        ratios.append(t_p / t_c)
        rows.append((r, tokens, tokens / t_p, tokens / t_c, t_p / t_c, valid))
    device = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"structured output, {device}, batch {batch_size}, model {args.model or 'default'}")
    print(f"compile the 30-field schema: cold {cold * 1e3:.1f} ms (tokenizer view included: "
          f"the engine's first constraint), cached {cached * 1e3:.3f} ms")
    print(f"{'round':>5} {'tokens':>7} {'plain tok/s':>12} {'schema tok/s':>13} {'ratio':>6} "
          f"{'complete':>9}")
    for r, tokens, plain, cons, ratio, valid in rows:
        print(f"{r:>5} {tokens:>7} {plain:>12.1f} {cons:>13.1f} {ratio:>6.3f} "
              f"{valid:>4}/{batch_size}")
    print(f"constrained / plain throughput: median {statistics.median(ratios):.3f} over "
          f"{len(ratios)} rounds (1.000: free; the goal is >= 0.95)")
    print(f"engine phases (s): {', '.join(f'{k} {v:.2f}' for k, v in engine.timing.items())}")


if __name__ == "__main__":
    main()
