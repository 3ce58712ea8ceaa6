"""`nanovllm generate`, `nanovllm chat` and `nanovllm serve`: the engine from a terminal.

main.py: the parser and exit statuses; arguments.py: the shared options; reply.py: one
streamed reply; generate.py, chat.py, serve.py: the commands."""

from nanovllm.entrypoints.cli.arguments import engine_config
from nanovllm.entrypoints.cli.main import build_parser, main

__all__ = ["build_parser", "engine_config", "main"]
