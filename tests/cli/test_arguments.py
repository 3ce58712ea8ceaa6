"""The options: one per EngineConfig field, each described with its default; names in
messages written as flags; --version."""

import argparse
import subprocess
import sys
from dataclasses import fields

from nanovllm import __version__
from nanovllm.core.config import EngineConfig
from nanovllm.entrypoints.cli import build_parser, engine_config
from nanovllm.entrypoints.cli.arguments import HelpFormatter, with_flags
from tests.cli.process import run_cli

COMMANDS = ("generate", "chat", "serve")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    """The commands that run an engine (`nanovllm trace` only reads a file)."""
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: p for name, p in action.choices.items() if name in COMMANDS}


def test_cli_help():
    for cmd in ("generate", "chat"):
        proc = subprocess.run(
            [sys.executable, "-m", "nanovllm", cmd, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0 and "--model" in proc.stdout and "--temperature" in proc.stdout


def test_help_describes_every_option_with_its_default():
    top = run_cli("--help")
    assert top.returncode == 0 and all(cmd in top.stdout for cmd in COMMANDS)
    for cmd, parser in _subparsers().items():
        shown = run_cli(cmd, "--help").stdout
        for field in fields(EngineConfig):  # a new field needs its flag in arguments.py
            assert field.name in {a.dest for a in parser._actions}, (cmd, field.name)
        for action in parser._actions:
            if action.dest == "help":
                continue
            text = HelpFormatter(cmd)._get_help_string(action)
            assert "default:" in text or not action.option_strings, (cmd, action.dest, text)
            assert all(flag in shown for flag in action.option_strings), (cmd, action.dest)
            if action.choices:
                assert "{" + ",".join(action.choices) + "}" in shown, (cmd, action.dest)


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout == f"nanovllm {__version__}\n"


def test_flags_set_the_engine_config():
    args = build_parser().parse_args([
        "serve", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--engine-seed", "3",
        "--threads", "2", "--num-gpu-blocks-override", "100", "--no-overlap", "--enforce-eager",
    ])
    assert engine_config(args) == EngineConfig(
        max_num_seqs=8, enable_prefix_caching=False, seed=3, num_threads=2, num_kv_blocks=100,
        overlap=False, enforce_eager=True,
    )
    assert engine_config(build_parser().parse_args(["generate", "hi"])) == EngineConfig()


def test_messages_name_flags():
    assert with_flags(
        "temperature=-1.0 is invalid; lower max_tokens or the context (max_model_len), not "
        "max_position_embeddings; stop early"
    ) == (
        "--temperature=-1.0 is invalid; lower --max-tokens or the context (--max-model-len), "
        "not max_position_embeddings; stop early"
    )
