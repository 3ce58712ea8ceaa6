"""The step trace drawn: `render_html` (one self-contained HTML page) and `render_png` (a
matplotlib summary, optional). Read a trace with nanovllm.core.step_trace.read_trace; the command
is `nanovllm trace FILE -o OUT.html [--png OUT.png]`."""

from nanovllm.trace.render import render_html
from nanovllm.trace.summary import render_png

__all__ = ["render_html", "render_png"]
