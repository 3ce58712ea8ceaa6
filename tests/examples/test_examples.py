"""The runnable examples (examples/): each runs as a user runs it, prints the walkthrough's
figures, and writes a step trace that read_trace reads, with the expected steps, rows and
preemptions."""

import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm.core.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, tmp_path: Path) -> tuple[str, dict, list[dict]]:
    trace = tmp_path / f"{name}.jsonl"
    proc = subprocess.run([sys.executable, f"examples/{name}.py", "--trace", str(trace)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header, steps = read_trace(str(trace))
    assert [s["step"] for s in steps] == list(range(len(steps)))
    return proc.stdout, header, steps


def work(step: dict) -> list[tuple[str, str, int]]:
    return [(r["req"], r["kind"], r["tokens"]) for r in step["rows"]]


def test_scheduling_walkthrough(tmp_path):
    out, header, steps = run_example("scheduling_walkthrough", tmp_path)
    assert "step 0 ran [A, B] (13 of 16 tokens); C waits: [C]" in out
    assert "step  0 | A prefill 6 (0->6), B prefill 7 (0->7) | waiting [C]" in out
    assert header["max_num_batched_tokens"] == 16
    assert header["config"]["scheduling_policy"] == "prefill_first"
    assert len(steps) == 4
    assert work(steps[0]) == [("A", "prefill", 6), ("B", "prefill", 7)]
    assert steps[0]["waiting"] == 1 and steps[0]["running"] == 2
    assert work(steps[1]) == [("C", "prefill", 5)]
    for step in steps[2:]:
        assert work(step) == [("A", "decode", 1), ("B", "decode", 1), ("C", "decode", 1)]
    assert [a["req"] for a in steps[0]["arrived"]] == ["A", "B", "C"]
    assert [(f["req"], f["reason"], f["output_tokens"]) for f in steps[3]["finished"]] == [
        ("A", "length", 3), ("B", "length", 3), ("C", "length", 3)]
    assert not any(s["preempted"] for s in steps)


def test_preemption_order(tmp_path):
    out, header, steps = run_example("preemption_order", tmp_path)
    assert "before step 1: running [A, B, C, D, E, F], waiting [G]" in out
    assert "after step 1:  running [A, B, C], waiting [D, E, F, G]" in out
    assert "preempted (tail first) [F, E, D]" in out
    assert "3 preemptions in all" in out
    assert header["num_kv_blocks"] == 6
    assert [[p["req"] for p in s["preempted"]] for s in steps][:2] == [[], ["F", "E", "D"]]
    assert sum(len(s["preempted"]) for s in steps) == 3
    assert all(p["kind"] == "recompute" for s in steps for p in s["preempted"])
    assert work(steps[1]) == [("A", "decode", 1), ("B", "decode", 1), ("C", "decode", 1)]
    assert steps[1]["waiting"] == 4 and steps[1]["running"] == 3
    assert steps[1]["blocks"]["freed"] == 3 and steps[1]["blocks"]["allocated"] == 3
    # recomputed later from their tokens: prompt and the output token kept
    recompute = next(s for s in steps[2:] if s["rows"][0]["req"] == "D")
    assert work(recompute) == [("D", "prefill", 5), ("E", "prefill", 5), ("F", "prefill", 5)]
    finished = {f["req"]: f["output_tokens"] for s in steps for f in s["finished"]}
    assert finished == dict.fromkeys("ABCDEFG", 3)


def test_long_prompt(tmp_path):
    out, header, steps = run_example("long_prompt", tmp_path)
    assert "1954 blocks of 256" in out and "31 chunks of 16,384 tokens, the last 8,480" in out
    assert header["block_size"] == 256 and header["max_num_batched_tokens"] == 16384
    prefill = [s for s in steps if s["rows"][0]["kind"] == "prefill"]
    assert [r["tokens"] for s in prefill for r in s["rows"]] == [16384] * 30 + [8480]
    assert [s["rows"][0]["start"] for s in prefill] == [i * 16384 for i in range(31)]
    assert steps[0]["kv"]["device"]["used"] == 1954  # the whole table before the first chunk
    assert steps[0]["blocks"]["allocated"] == 1954
    assert [work(s) for s in steps[31:]] == [[("L", "decode", 1)]] * 3
    assert steps[-1]["finished"] == [{"req": "L", "seq": 0, "reason": "length",
                                      "output_tokens": 4}]


@pytest.mark.parametrize("name", ["scheduling_walkthrough", "preemption_order", "long_prompt"])
def test_without_trace(name):
    proc = subprocess.run([sys.executable, f"examples/{name}.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step  0 |" in proc.stdout
