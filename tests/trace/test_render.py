"""The trace page, its PNG summary and `nanovllm trace`, read as text (no browser here:
test_browser.py opens the page in Chromium)."""

import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from nanovllm.core.step_trace import StepTrace, read_trace
from nanovllm.entrypoints.cli import main
from nanovllm.trace import render_html, render_png
from nanovllm.trace.figures import MAX_POINTS
from tests.trace.synthetic import simulate

SVG_NS = "http://www.w3.org/2000/svg"  # the script's createElementNS: a name, not a fetch


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    """Six requests, chunked prefill, one swap and one recompute preemption."""
    return simulate(tmp_path / "run.jsonl", preempt={8: "swap", 14: "recompute"})


def card(page: str, name: str) -> str:
    """The text of one totals card: its figure and the line under it."""
    m = re.search(rf'data-total="{re.escape(name)}">(.*?)</div>', page)
    assert m, f"no card {name!r}"
    return re.sub(r"<[^>]+>", " ", m.group(1))


def test_page_is_self_contained(small_trace: Path) -> None:
    page = render_html(*read_trace(str(small_trace)))
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:[a-z]+:)?//""", page, re.I)
    assert not re.search(r"@import|url\(|<link\b|<script\s+src|<iframe|<img\b", page, re.I)
    assert set(re.findall(r"https?://[^\s\"'<>)]+", page)) <= {SVG_NS}
    assert page.startswith("<!doctype html>") and page.count("<script>") == 1
    for svg in re.findall(r"<svg\b.*?</svg>", page, re.S):  # every chart well-formed XML
        ET.fromstring(svg)


def test_page_shows_every_request_and_event(small_trace: Path) -> None:
    header, steps = read_trace(str(small_trace))
    page = render_html(header, steps)
    reqs = {a["req"] for s in steps for a in s["arrived"]}
    assert len(reqs) == 6
    for req in reqs:
        assert page.count(f'data-req="{req}"') == 1, req
    for kind in ("swap", "recompute"):
        victim = next(p["req"] for s in steps for p in s["preempted"] if p["kind"] == kind)
        assert re.search(rf'class="pm pm-{kind}"[^>]*><title>{victim}: preempted \({kind}\)',
                         page)
    reasons = Counter(f["reason"] for s in steps for f in s["finished"])
    assert set(reasons) == {"stop", "length", "abort"}
    for reason, n in reasons.items():
        assert page.count(f'class="fin fin-{reason}"') == n
    assert 'class="prefill"' in page and 'class="decode"' in page and 'class="queued"' in page
    assert re.search(r"prefill tokens \d+–\d+ of \d+", page)  # a chunk's hover title
    assert len(re.findall(r'<rect class="hov"', page)) == len(steps)  # a column per step
    for f in ("used", "cached", "free"):  # device and host tiers
        assert page.count(f'class="kv-{f}"') == 2


def test_page_header_holds_the_totals_and_config(small_trace: Path) -> None:
    header, steps = read_trace(str(small_trace))
    page = render_html(header, steps)
    tokens = Counter()
    blocks = Counter()
    for s in steps:
        blocks.update(s["blocks"])
        for r in s["rows"]:
            tokens[r["kind"]] += r["tokens"]
    assert blocks["hit_device"] and blocks["hit_host"] and blocks["swapped_out"]
    assert f" {len(steps)} " in card(page, "steps")
    assert f"{sum(tokens.values()):,}" in card(page, "tokens")
    assert f"prefill {tokens['prefill']:,} · decode {tokens['decode']:,}" in card(page, "tokens")
    assert "swap 1 · recompute 1" in card(page, "preemptions")
    assert (f"device {blocks['hit_device']} · host {blocks['hit_host']}"
            in card(page, "prefix hits (blocks)"))
    assert (f"out {blocks['swapped_out']} · in {blocks['swapped_in']}"
            in card(page, "swaps (blocks)"))
    wall = steps[-1]["t"] + steps[-1]["dur"]
    assert f"{wall * 1000:.1f} ms" in card(page, "wall time")
    assert "6 arrived" in card(page, "requests")
    for key in ("num_kv_blocks", "num_host_blocks", "max_num_batched_tokens", "tiny-llama"):
        assert f"<td>{key}</td>" in page


def test_request_ids_are_escaped(tmp_path: Path) -> None:
    path = tmp_path / "evil.jsonl"
    trace = StepTrace(str(path))
    trace.header(block_size=16, num_kv_blocks=8, num_host_blocks=0, config={"x": "<u>evil</u>"})
    evil = '"><script>alert(1)</script>'
    trace.arrived(evil, 0, 4)
    kv = {"device": {"used": 1, "cached": 0, "free": 7}, "host": {"used": 0, "cached": 0,
                                                                  "free": 0}}
    trace.step(0.0, 0.01, [{"req": evil, "seq": 0, "kind": "prefill", "tokens": 4, "start": 0,
                            "total": 4}], 0, 1, kv, {}, [])
    trace.finished(evil, 0, "stop<", 1)
    trace.step(0.01, 0.01, [{"req": evil, "seq": 0, "kind": "decode", "tokens": 1, "start": 4,
                             "total": 5}], 0, 0, kv, {}, [])
    trace.close()
    page = render_html(*read_trace(str(path)))
    assert "<script>alert" not in page and "<u>" not in page and "&lt;u&gt;evil" in page
    assert page.count("<script>") == 1 and "&lt;script&gt;alert(1)" in page
    assert 'class="kv-used"' in page and page.count('class="kv-free"') == 1  # no host tier
    for svg in re.findall(r"<svg\b.*?</svg>", page, re.S):
        ET.fromstring(svg)


def test_empty_trace(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    trace = StepTrace(str(path))
    trace.header(block_size=16, num_kv_blocks=64, num_host_blocks=0, config={})
    trace.close()
    header, steps = read_trace(str(path))
    page = render_html(header, steps)
    assert "No steps recorded" in page and "<svg" not in page
    assert " 0 " in card(page, "steps") and "document.body.dataset.rendered" in page
    render_png(header, steps, str(tmp_path / "empty.png"))
    assert matplotlib.image.imread(tmp_path / "empty.png").shape[:2] == (1100, 1200)


def test_png_summary(small_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.png"
    render_png(*read_trace(str(small_trace)), str(out))
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert 20_000 < out.stat().st_size < 2_000_000
    pixels = matplotlib.image.imread(out)
    assert pixels.shape == (1100, 1200, 4)
    rgb = (pixels[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 100  # drawn, not blank
    for color in ((0x4E, 0x79, 0xA7), (0xF2, 0x8E, 0x2B)):  # decode and prefill bars
        assert (rgb == color).all(axis=1).sum() > 1000


def test_cli_writes_the_page_and_png(small_trace: Path, tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "out" / "page.html", tmp_path / "summary.png"
    out.parent.mkdir()
    assert main(["trace", str(small_trace), "-o", str(out), "--png", str(png)]) == 0
    assert "data-req=" in out.read_text() and png.stat().st_size > 20_000
    assert main(["trace", str(small_trace)]) == 0  # the default: FILE with .html
    assert small_trace.with_suffix(".html").read_text() == out.read_text()
    assert str(out) in capsys.readouterr().out


@pytest.mark.parametrize("content, says", [
    (None, "no trace file"),
    ('{"type": "header", "version": 1}\n{"type": "step", "t"', "not JSON"),
    ('{"type": "header", "version": 2}\n', "trace version 2"),
    ('{"type": "step"}\n', "no header line"),
    ('{"type": "header", "version": 1}\n{"type": "step", "step": 0}\n', "lacks a field"),
    ("dir", "is a directory"),
])
def test_cli_bad_trace_exits_2(tmp_path: Path, capsys, content: str | None, says: str) -> None:
    path = tmp_path / "run.jsonl"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    assert main(["trace", str(path), "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "x.html").exists()


def test_cli_refuses_to_overwrite_the_trace(small_trace: Path, capsys) -> None:
    before = small_trace.read_text()
    assert main(["trace", str(small_trace), "-o", str(small_trace)]) == 2
    assert "give -o another path" in capsys.readouterr().err
    assert small_trace.read_text() == before


def test_cli_unwritable_output_exits_2(small_trace: Path, tmp_path: Path, capsys) -> None:
    assert main(["trace", str(small_trace), "-o", str(tmp_path / "no" / "x.html")]) == 2
    assert "cannot write" in capsys.readouterr().err


@pytest.fixture(scope="module")
def large_trace(tmp_path_factory) -> tuple[dict, list[dict]]:
    """20,000 steps of 2,000 requests (16 running, up to hundreds waiting), a preemption every
    500 steps, swap and recompute in turn."""
    preempt = {i: ("swap", "recompute")[i // 500 % 2] for i in range(250, 20_000, 500)}
    path = simulate(tmp_path_factory.mktemp("large") / "large.jsonl", n_requests=2000,
                    preempt=preempt,
                    max_num_seqs=16, budget=512, num_kv_blocks=1024, num_host_blocks=512,
                    output=(20, 300), arrival_span=40.0, max_steps=20_000)
    return read_trace(str(path))


def test_large_trace_page_stays_small(large_trace: tuple[dict, list[dict]]) -> None:
    header, steps = large_trace
    assert len(steps) == 20_000
    page = render_html(header, steps)
    assert len(page.encode()) < 5_000_000
    assert page.count('class="lane"') == 2000
    assert len(re.findall(r'<rect class="hov"', page)) <= MAX_POINTS
    # a lane's decode steps merge: far fewer decode bars than decode rows
    decode_rows = sum(r["kind"] == "decode" for s in steps for r in s["rows"])
    assert page.count('<rect class="decode"') < decode_rows / 20
    assert page.count('class="pm pm-swap"') == page.count('class="pm pm-recompute"') == 20
