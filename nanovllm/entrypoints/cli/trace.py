"""`nanovllm trace`: a step trace (LLM(trace=FILE), `nanovllm serve --trace FILE`) drawn as one
self-contained HTML page, and with --png a matplotlib summary as well."""

import argparse
from pathlib import Path

from nanovllm.core.errors import ConfigError
from nanovllm.core.trace import read_trace
from nanovllm.trace import render_html, render_png

WRITTEN_BY = "a trace written by LLM(trace=FILE) or `nanovllm serve --trace FILE`"


def add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="the step trace, JSON lines written by "
                   "LLM(trace=FILE) or `nanovllm serve --trace FILE`")
    p.add_argument("-o", "--output", metavar="OUT.html", default=None,
                   help="where to write the page (default: FILE with the suffix .html)")
    p.add_argument("--png", metavar="OUT.png", default=None,
                   help="also write a PNG summary, drawn by matplotlib (pip install "
                   "'nanovllm[bench]') (default: none)")


def cmd_trace(args: argparse.Namespace) -> int:
    header, steps = load(args.file)
    out = Path(args.output or Path(args.file).with_suffix(".html"))
    if out.resolve() == Path(args.file).resolve():
        raise ConfigError(f"the page would overwrite the trace {args.file}; give -o another path")
    try:
        page = render_html(header, steps)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ConfigError(f"{args.file}: a record lacks a field or holds a wrong type "
                          f"({type(e).__name__}: {e}); give {WRITTEN_BY}") from None
    _write(out, lambda: out.write_text(page, encoding="utf-8"))
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--png needs matplotlib: pip install matplotlib (or the bench "
                              "extra, 'nanovllm[bench]'), or leave --png out") from None
        _write(Path(args.png), lambda: render_png(header, steps, args.png))
    print(f"{out}: {len(steps):,} steps" + (f"; {args.png}" if args.png else ""))
    return 0


def load(path: str) -> tuple[dict, list[dict]]:
    """The trace at `path`, or a ConfigError that says what to change."""
    try:
        return read_trace(path)
    except FileNotFoundError:
        raise ConfigError(f"no trace file {path}: give the path of {WRITTEN_BY}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory: give the path of {WRITTEN_BY}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text: give {WRITTEN_BY}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}): give a readable trace") from None
    except ValueError as e:  # not JSON, an unknown record, no header, another version
        raise ConfigError(f"{e}; give {WRITTEN_BY} (JSON lines, version 1)") from None


def _write(path: Path, write) -> None:
    try:
        write()
    except OSError as e:
        raise ConfigError(f"cannot write {path} ({e.strerror}); give a path in a writable "
                          "directory") from None
