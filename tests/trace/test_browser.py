"""The trace page in a real browser: Debian's headless Chromium loads it from a file (nothing
to fetch), runs its script without an error, and paints the charts."""

import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from nanovllm.core.step_trace import read_trace
from nanovllm.trace import render_html
from tests.trace.synthetic import simulate

pytestmark = pytest.mark.browser

N_REQUESTS = 60
COLORS = {"decode": (0x4E, 0x79, 0xA7), "prefill": (0xF2, 0x8E, 0x2B),
          "KV cached": (0x8C, 0xD1, 0xC9), "queued": (0xD5, 0xD5, 0xD5)}


def chromium(page: Path, tmp_path: Path, *args: str) -> tuple[str, str]:
    """Chromium's standard output and its log (console messages included) for `page`."""
    run = subprocess.run(
        [shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
         "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}",
         *args, page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return run.stdout, run.stderr


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """A page of 60 requests, some preempted (swap and recompute), with a host tier."""
    where = tmp_path_factory.mktemp("browser")
    trace = simulate(where / "run.jsonl", n_requests=N_REQUESTS, max_num_seqs=8, budget=256,
                     preempt={40: "swap", 90: "recompute", 150: "swap"}, num_kv_blocks=256,
                     num_host_blocks=128, output=(10, 60), arrival_span=0.4)
    out = where / "run.html"
    out.write_text(render_html(*read_trace(str(trace))), encoding="utf-8")
    return out


def test_script_runs_and_the_charts_are_in_the_dom(page: Path, tmp_path: Path) -> None:
    dom, log = chromium(page, tmp_path, "--dump-dom")
    assert 'data-rendered="ok"' in dom, "the page's script did not run to its end"
    assert not re.search(r"CONSOLE.*(Uncaught|Error)", log), log
    assert dom.count("<svg") == 2  # the timeline and the Gantt chart
    assert dom.count('<line class="cursor"') == 2  # made by the script, one per chart
    assert dom.count('class="lane"') == N_REQUESTS
    assert dom.count('<polygon class="kv-') == 6  # used, cached, free in two tiers
    assert dom.count('<polyline class="q-') == 2
    assert 'class="pm pm-swap"' in dom and 'class="pm pm-recompute"' in dom


def test_screenshot_shows_the_charts(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,2000",
             "--hide-scrollbars")
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (2000, 1400)
    rgb = (pixels[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 200, "a blank page"
    for name, color in COLORS.items():
        assert (rgb == color).all(axis=1).sum() > 2000, f"no {name} painted"


def test_empty_trace_page_runs_its_script(tmp_path: Path) -> None:
    trace = tmp_path / "empty.jsonl"
    trace.write_text('{"type": "header", "version": 1, "num_kv_blocks": 8}\n')
    out = tmp_path / "empty.html"
    out.write_text(render_html(*read_trace(str(trace))), encoding="utf-8")
    dom, log = chromium(out, tmp_path, "--dump-dom")
    assert 'data-rendered="ok"' in dom and "No steps recorded" in dom
    assert "Uncaught" not in log
