"""`nanovllm generate`: complete one prompt, given as an argument or on standard input."""

import argparse
import sys

from nanovllm.core.errors import InvalidRequestError
from nanovllm.entrypoints.cli.arguments import engine_config, sampling_params
from nanovllm.entrypoints.cli.loading import load_engine
from nanovllm.entrypoints.cli.reply import fit_to_context, stream_reply


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompt", nargs="?", default=None,
        help="the text to complete; - reads it from standard input, as does no prompt when "
        "standard input is not a terminal",
    )
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as it is, without the model's chat template")


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad options fail before the model loads
    config = engine_config(args)
    text = read_prompt(args.prompt)
    engine = load_engine(args, config)
    prompt = text
    if not args.raw and engine.tokenizer.chat_template:
        prompt = engine.render_chat([{"role": "user", "content": text}])
    ids, params = fit_to_context(engine, prompt, params, explicit=args.max_tokens is not None)
    stream_reply(engine, ids, params, explicit=args.max_tokens is not None)
    return 0


def read_prompt(arg: str | None) -> str:
    """The prompt text: `arg`, or standard input for "-" (or no `arg` when it is piped),
    without the final newline that `echo` and editors add."""
    if arg == "-" or (arg is None and not sys.stdin.isatty()):
        arg = sys.stdin.read().removesuffix("\n")
    elif arg is None:
        raise InvalidRequestError("give a prompt, or - to read it from standard input", "prompt")
    if not arg.strip():
        raise InvalidRequestError("the prompt is empty; give some text to complete", "prompt")
    return arg
