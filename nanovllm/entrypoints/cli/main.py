"""The `nanovllm` command: its parser, logging, and how errors and Ctrl-C end it."""

import argparse
import logging
import os
import sys

from nanovllm import __version__
from nanovllm.core.errors import NanoVLLMError
from nanovllm.entrypoints.cli.arguments import (
    HelpFormatter,
    add_engine_args,
    add_sampling_args,
    with_flags,
)
from nanovllm.entrypoints.cli.chat import cmd_chat
from nanovllm.entrypoints.cli.generate import add_prompt_args, cmd_generate
from nanovllm.entrypoints.cli.serve import add_server_args, cmd_serve
from nanovllm.entrypoints.cli.trace import add_trace_args, cmd_trace

EXAMPLES = """\
examples:
  nanovllm generate "Write a haiku about the sea." --temperature 0.8 --seed 3
  echo "Once upon a time" | nanovllm generate - --raw --max-tokens 64
  nanovllm chat --system "You are terse."
  nanovllm serve --port 8000
  nanovllm trace run.jsonl -o run.html --png run.png

Without --model the default model (SmolLM2-135M-Instruct) runs. Bad input exits with
status 2 and one line "error: ..."; Ctrl-C exits with status 130."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanovllm", description="nano-vLLM: a compact LLM inference engine.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nanovllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser(
        "generate", formatter_class=HelpFormatter,
        help="complete one prompt and print the result as it is generated",
        description="Complete one prompt, printing the result as it is generated. The "
        "model's chat template is applied unless --raw is given. An output cut short "
        "(--max-tokens, a full context) says why on standard error.",
    )
    add_prompt_args(gen)
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser(
        "chat", formatter_class=HelpFormatter, help="talk with the model in the terminal",
        description="A conversation in the terminal, each reply streamed. /help lists the "
        "commands (/reset, /system, /exit).",
    )
    chat.add_argument("--system", metavar="TEXT", default=None,
                      help="system prompt (default: none)")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser(
        "serve", formatter_class=HelpFormatter, help="serve the model over OpenAI's HTTP API",
        description="Serve the model over HTTP with OpenAI's /v1/completions and "
        "/v1/chat/completions (streamed or not), plus /health, /metrics and /tokenize.",
    )
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)
    trace = sub.add_parser(
        "trace", formatter_class=HelpFormatter, help="draw a step trace as an HTML page",
        description="Draw a step trace (LLM(trace=FILE), serve --trace FILE) as one "
        "self-contained HTML page: totals, tokens, queues and KV use over time, a lane per "
        "request.",
    )
    add_trace_args(trace)
    trace.set_defaults(func=cmd_trace, verbose=False)
    worker = sub.add_parser(
        "worker", formatter_class=HelpFormatter,
        help="serve one tensor-parallel rank other than 0 (under torchrun or Slurm)",
        description="Serve one tensor-parallel rank other than 0 until rank 0 ends. The "
        "ranks meet through the env:// variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
        "and LOCAL_RANK; rank 0 runs `nanovllm generate/serve --tensor-parallel-size "
        "WORLD_SIZE` with the same variables and sends the model and settings.",
    )
    worker.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    worker.set_defaults(func=cmd_worker)
    return parser


ENGINE_COMMANDS = ("generate", "chat", "serve")


def _launched_rank() -> int:
    """RANK when a launcher set the env:// variables (WORLD_SIZE), else 0."""
    if "WORLD_SIZE" not in os.environ:
        return 0
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from nanovllm.worker.tp_worker import run_worker

    level = os.environ.get("NANOVLLM_LOG_LEVEL")  # set by a rank 0 that started this one
    if level is not None:
        logging.getLogger("nanovllm").setLevel(int(level))
    return run_worker()


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status: 2 for bad input, 130 after Ctrl-C."""
    try:
        args = build_parser().parse_args(argv)
        _configure_logging(args.verbose, timestamps=args.verbose or args.command == "serve")
        if args.command in ENGINE_COMMANDS and _launched_rank() > 0:
            # torchrun / Slurm start the same command on every rank: the others serve rank 0
            return cmd_worker(args)
        return args.func(args)
    except NanoVLLMError as e:
        message = " ".join(with_flags(str(e)).split())  # one line, whatever the message
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a line the output left open was ended where it stopped
        return 130
    except BrokenPipeError:  # the reader left (`| head`); quiet too when Python flushes at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _configure_logging(verbose: bool, timestamps: bool) -> None:
    """Warnings only, or with --verbose the nanovllm loggers' INFO lines (load progress);
    other libraries stay at warnings either way."""
    when = "%(asctime)s " if timestamps else ""
    logging.basicConfig(level=logging.WARNING, format=when + "%(levelname)s %(name)s: %(message)s")
    if verbose:
        logging.getLogger("nanovllm").setLevel(logging.INFO)
