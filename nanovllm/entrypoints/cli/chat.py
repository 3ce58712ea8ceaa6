"""`nanovllm chat`: a conversation in the terminal, each reply streamed; /commands steer it."""

import argparse
import re
import sys

from nanovllm.core.errors import NanoVLLMError
from nanovllm.core.validation import CONTEXT_LENGTH_EXCEEDED
from nanovllm.entrypoints.cli.arguments import engine_config, sampling_params, with_flags
from nanovllm.entrypoints.cli.loading import load_engine
from nanovllm.entrypoints.cli.reply import fit_to_context, stream_reply

HELP = """\
/help          this list
/reset         start a new conversation (the system prompt stays)
/system TEXT   set the system prompt; /system alone shows it
/exit, /quit   leave (as do Ctrl-D and Ctrl-C at the prompt)
Ctrl-C during a reply stops it. Start a line with // to send one that begins with /."""
_COMMAND = re.compile(r"/[A-Za-z]+")  # "/usr/bin is ..." is a message, not a command


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad options fail before the model loads
    engine = load_engine(args, engine_config(args))
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    system, history = args.system, []
    print("Chatting with the model; /help lists the commands, Ctrl-D leaves.")
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        command, _, rest = line.partition(" ")
        if not _COMMAND.fullmatch(command):
            if line:
                message = line[1:] if line.startswith("//") else line
                _turn(engine, system, history, message, params, args)
        elif command in ("/exit", "/quit"):
            return 0
        elif command == "/help":
            print(HELP)
        elif command == "/reset":
            history.clear()
            print("(new conversation" + (", same system prompt)" if system else ")"))
        elif command == "/system" and rest.strip():
            system = rest.strip()
            print("(system prompt set)")
        elif command == "/system":
            print(system or "(no system prompt)")
        else:
            print(f"error: unknown command {command}; /help lists the commands",
                  file=sys.stderr)


def _turn(engine, system: str | None, history: list[dict], line: str, params,
          args: argparse.Namespace) -> None:
    """Reply to `line`, adding both to `history` unless the reply fails or is stopped."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [*history, {"role": "user", "content": line}]
    explicit = args.max_tokens is not None
    try:
        ids, fitted = fit_to_context(engine, engine.render_chat(messages), params, explicit)
        reply = stream_reply(engine, ids, fitted, explicit)
    except KeyboardInterrupt:
        return  # stopped: the exchange is left out of the conversation
    except NanoVLLMError as e:
        full = getattr(e, "code", None) == CONTEXT_LENGTH_EXCEEDED
        hint = "; /reset starts a new conversation" if full else ""
        print(f"error: {with_flags(str(e))}{hint}", file=sys.stderr)
        return
    history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
