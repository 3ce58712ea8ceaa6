"""`nanovllm generate` as a user runs it: bad input is one line and status 2, the prompt may
come on standard input, an output cut short says why, Ctrl-C ends quietly with 130."""

import os
import pty
import re
import signal
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from tests.cli.process import (
    finish,
    press_ctrl_c_in_a_finalizer,
    read_until,
    run_cli,
    start_cli,
)
from tests.support import build_tiny_model


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_a_missing_model_is_one_line():
    # bad options and prompts fail before this (below); a missing model when it loads
    line = _one_error_line(run_cli("generate", "hi", "--model", "/does/not/exist"))
    assert "'/does/not/exist' does not exist" in line


def test_bad_prompts_fail_before_the_model_loads():
    # a model that does not exist: these errors come first, so nothing was loaded
    for args, stdin in (([""], ""), (["  \n"], ""), (["--raw", ""], ""), (["-"], " \n"), ([], "")):
        proc = run_cli("generate", *args, "--model", "/does/not/exist", input=stdin)
        assert _one_error_line(proc) == "error: the prompt is empty; give some text to complete"
    proc = run_cli("generate", "hi", "--model", "/does/not/exist", "--temperature", "-1")
    assert "--temperature=-1.0 is invalid" in _one_error_line(proc)
    _, terminal = pty.openpty()  # no prompt, and standard input is a terminal
    proc = subprocess.run([sys.executable, "-m", "nanovllm", "generate"], stdin=terminal,
                          capture_output=True, text=True, timeout=60)
    os.close(terminal)
    assert "give a prompt, or - to read it from standard input" in _one_error_line(proc)


def test_too_long_requests_say_which_flag_to_change(tiny_llama):
    model = ["--model", str(tiny_llama), "--device", "cpu"]
    line = _one_error_line(run_cli("generate", "hi", *model, "--max-tokens", "100000"))
    assert "--max-tokens is 100000" in line and "lower --max-tokens to at most" in line
    assert "None" not in line and "max_tokens" not in line
    line = _one_error_line(run_cli("generate", "hi", *model, "--max-model-len", "40000"))
    assert line.startswith("error: --max-model-len=40000 is longer than the model's context "
                           "of 512 tokens"), line


def test_output_cut_short_says_why(tiny_llama):
    model = ["--model", str(tiny_llama), "--device", "cpu", "--ignore-eos"]
    # "-" reads standard input; --verbose shows timed load progress
    proc = run_cli("generate", "-", *model, "--max-tokens", "5", "-v", input="hello\n")
    assert proc.returncode == 0 and proc.stdout.endswith("\n"), proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == "[stopped: reached --max-tokens 5]", proc.stderr
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO nanovllm"
    assert all(re.match(stamp, line) for line in lines[:-1]), proc.stderr
    assert "loading" in lines[0] and any("ready in" in line for line in lines), proc.stderr
    # no prompt: standard input, here one that leaves less room than the default 256 tokens
    # in a 64-token context: the default shrinks to it, and generation fills the context
    prompt = "The quick brown fox jumps over the lazy dog."
    tokenizer = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    assert 8 < len(tokenizer.encode(prompt).ids) < 56
    proc = run_cli("generate", "--raw", *model, "--max-model-len", "64", input=prompt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "[stopped: the context of 64 tokens is full]\n"

def test_ctrl_c_ends_quietly_with_status_130(tiny_llama):
    model = ["--model", str(tiny_llama), "--device", "cpu"]
    for command in (["generate", "hi"], ["chat"]):  # while the model loads
        proc = start_cli(*command, *model, "-v")
        read_until(proc.stderr, b"loading")
        proc.send_signal(signal.SIGINT)
        status, out, err = finish(proc)
        assert status == 130 and out == "" and "Traceback" not in err, (command, err)
    # while the output streams: it ends with its line ended, and no note of why it stopped
    proc = start_cli("generate", "hi", "--raw", *model, "--ignore-eos", "--max-tokens", "500")
    first = read_until(proc.stdout).decode(errors="replace")
    proc.send_signal(signal.SIGINT)
    status, out, err = finish(proc)
    assert status == 130 and err == "" and (first + out).endswith("\n"), (first, out, err)


def test_ctrl_c_to_the_process_group_under_tensor_parallelism(tmp_path):
    """A terminal's Ctrl-C reaches every process of the group, the rank that rank 0 started
    too: rank 0 stops it in its own time, so the command still ends quietly with 130 (a
    rank ending on the signal itself made it "rank 1 exited with code 130", status 2)."""
    model = build_tiny_model(tmp_path / "model", "llama", max_position_embeddings=16384)
    proc = start_cli("generate", "hi", "--raw", "--model", str(model), "--device", "cpu",
                     "-tp", "2", "--max-model-len", "16384", "--ignore-eos",
                     "--max-tokens", "16000", group=True)
    first = read_until(proc.stdout).decode(errors="replace")
    os.killpg(proc.pid, signal.SIGINT)
    status, out, err = finish(proc)
    assert status == 130 and err == "" and (first + out).endswith("\n"), (status, err)


def test_a_ctrl_c_python_drops_while_loading_still_stops(capsys, monkeypatch):
    """A Ctrl-C whose KeyboardInterrupt is raised inside a finalizer (or an import lock's
    callback, as CI twice caught while the model loaded) is dropped by Python, which prints
    it with a traceback; loading raises it again once done, so the command stops instead of
    running to its end, and prints nothing."""
    from nanovllm.entrypoints.ctrl_c import ctrl_c_kept

    # Python's own hook, which prints what it drops (pytest's would turn it into a warning)
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    with pytest.raises(KeyboardInterrupt), ctrl_c_kept():
        press_ctrl_c_in_a_finalizer()
    assert "Traceback" not in capsys.readouterr().err
