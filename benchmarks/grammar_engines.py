"""llguidance against xgrammar on our tokenizers: the measurement behind the engine's choice
(docs/structured-output.md).

    python -m benchmarks.grammar_engines                 # the default model's tokenizer
    python -m benchmarks.grammar_engines --model DIR     # a Hugging Face directory's tokenizer

Each engine runs in a fresh child process (`--worker NAME`), so its import and start-up are
its own. Per engine:

- import: `import llguidance` / `import xgrammar` (xgrammar pulls torch and transformers in).
- tokenizer: building the engine's view of our tokenizer (done once per engine).
- compile cold / cached: a 30-field JSON schema (strings, integers, numbers, booleans,
  enums, an array, a nested object) compiled the first time, then the same schema again
  through the engine's own cache (xgrammar's GrammarCompiler cache; for llguidance, the
  grammar string kept by key, as the engine does, and a new matcher made from it).
- mask: the time to fill the next-token bitmask, per token, while walking one valid
  instance of the schema token by token (its encoding by our tokenizer): one matcher
  (batch 1), and 64 matchers filled together each step (batch 64: llguidance's parallel
  executor; xgrammar's BatchGrammarMatcher), per step and per row.
"""

import argparse
import importlib.metadata
import json
import subprocess
import sys
import time

FIELDS = 30
BATCH = 64


def schema_and_instance() -> tuple[dict, dict]:
    """A 30-field object schema (every field required) and one instance of it."""
    props: dict = {}
    value: dict = {}
    kinds = ["string", "integer", "number", "boolean", "enum", "array", "object"]
    for i in range(FIELDS):
        kind = kinds[i % len(kinds)]
        name = f"field_{i:02d}"
        if kind == "enum":
            props[name] = {"enum": ["red", "green", "blue"]}
            value[name] = "green"
        elif kind == "array":
            props[name] = {"type": "array", "items": {"type": "integer"}, "maxItems": 4}
            value[name] = [1, 2, 3]
        elif kind == "object":
            props[name] = {"type": "object", "properties": {"x": {"type": "number"},
                           "y": {"type": "string"}}, "required": ["x", "y"],
                           "additionalProperties": False}
            value[name] = {"x": 1.5, "y": "up"}
        else:
            props[name] = {"type": kind}
            value[name] = {"string": "some text", "integer": 42, "number": 3.25,
                           "boolean": True}[kind]
    schema = {"type": "object", "properties": props, "required": list(props),
              "additionalProperties": False}
    return schema, value


def _tokenizer(model: str | None):
    from nanovllm.engine.tokenizer import Tokenizer
    from nanovllm.model.loader.source import default_model_path

    return Tokenizer.load(model or default_model_path())


def run_llguidance(model: str | None) -> dict:
    t0 = time.perf_counter()
    import llguidance
    import llguidance.numpy as lnp

    t_import = time.perf_counter() - t0
    tok = _tokenizer(model)
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                   eos_token=sorted(tok.eos_token_ids))
    t_tok = time.perf_counter() - t0
    schema, instance = schema_and_instance()
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(lltok, grammar)
    t_cold = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    cache = {json.dumps(schema, sort_keys=True): grammar}
    t0 = time.perf_counter()
    llguidance.LLMatcher(lltok, cache[json.dumps(schema, sort_keys=True)])
    t_cached = time.perf_counter() - t0
    ids = tok.encode(json.dumps(instance), add_special_tokens=False)
    mask = lnp.allocate_token_bitmask(1, lltok.vocab_size)
    t_mask = 0.0
    for tid in ids:
        t0 = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        t_mask += time.perf_counter() - t0
        assert matcher.consume_token(tid), matcher.get_error()
    executor = llguidance.LLExecutor()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    masks = lnp.allocate_token_bitmask(BATCH, lltok.vocab_size)
    t_batch = 0.0
    for tid in ids:
        t0 = time.perf_counter()
        lnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], masks)
        t_batch += time.perf_counter() - t0
        for m in matchers:
            m.consume_token(tid)
    name = "llguidance " + importlib.metadata.version("llguidance")
    return _figures(name, t_import, t_tok, t_cold, t_cached, t_mask, t_batch, len(ids))


def run_xgrammar(model: str | None) -> dict:
    t0 = time.perf_counter()
    import torch
    import transformers
    import xgrammar

    t_import = time.perf_counter() - t0
    tok = _tokenizer(model)
    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    info = xgrammar.TokenizerInfo.from_huggingface(
        hf, vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.eos_token_ids))
    compiler = xgrammar.GrammarCompiler(info)
    t_tok = time.perf_counter() - t0
    schema, instance = schema_and_instance()
    text = json.dumps(schema)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(text)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile_json_schema(text)
    t_cached = time.perf_counter() - t0
    ids = tok.encode(json.dumps(instance), add_special_tokens=False)
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    t_mask = 0.0
    for tid in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        t_mask += time.perf_counter() - t0
        assert matcher.accept_token(tid)
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(BATCH)]
    masks = xgrammar.allocate_token_bitmask(BATCH, info.vocab_size)
    batch = xgrammar.BatchGrammarMatcher() if hasattr(xgrammar, "BatchGrammarMatcher") else None
    t_batch = 0.0
    for tid in ids:
        t0 = time.perf_counter()
        if batch is not None:
            batch.batch_fill_next_token_bitmask(matchers, masks)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(masks, i)
        t_batch += time.perf_counter() - t0
        for m in matchers:
            m.accept_token(tid)
    del torch
    name = "xgrammar " + importlib.metadata.version("xgrammar")
    return _figures(name, t_import, t_tok, t_cold, t_cached, t_mask, t_batch, len(ids))


def _figures(name, t_import, t_tok, t_cold, t_cached, t_mask, t_batch, n) -> dict:
    return {"engine": name, "import_s": t_import, "tokenizer_s": t_tok,
            "compile_cold_ms": t_cold * 1e3, "compile_cached_ms": t_cached * 1e3,
            "mask_b1_us": t_mask / n * 1e6, "mask_b64_step_us": t_batch / n * 1e6,
            "mask_b64_row_us": t_batch / n / BATCH * 1e6, "tokens": n}


WORKERS = {"llguidance": run_llguidance, "xgrammar": run_xgrammar}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a Hugging Face directory or GGUF file (default model)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.model)))
        return
    rows = []
    for name in WORKERS:
        cmd = [sys.executable, "-m", "benchmarks.grammar_engines", "--worker", name]
        if args.model:
            cmd += ["--model", args.model]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            print(f"{name}: failed\n{done.stderr[-2000:]}")
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'engine':<20} {'import s':>9} {'tokenizer s':>12} {'compile ms':>11} "
          f"{'cached ms':>10} {'mask us b1':>11} {'b64 step us':>12} {'b64 row us':>11}")
    for r in rows:
        print(f"{r['engine']:<20} {r['import_s']:>9.2f} {r['tokenizer_s']:>12.2f} "
              f"{r['compile_cold_ms']:>11.2f} {r['compile_cached_ms']:>10.3f} "
              f"{r['mask_b1_us']:>11.1f} {r['mask_b64_step_us']:>12.1f} "
              f"{r['mask_b64_row_us']:>11.1f}")
    print(f"({rows[0]['tokens'] if rows else 0} tokens of one valid instance; "
          f"{FIELDS}-field schema; batch {BATCH})")


if __name__ == "__main__":
    main()
