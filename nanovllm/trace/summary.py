"""A step trace as one PNG of four panels (matplotlib, optional: the `bench` extra): tokens per
step, queue lengths, KV blocks by tier, and a small request Gantt, all over wall time. The
figures are the HTML page's (figures.py), lanes merged at its pixel (render.PLOT)."""

from nanovllm.trace.figures import lanes, points, totals
from nanovllm.trace.render import PLOT

GANTT_COLORS = {"queued": "#d5d5d5", "prefill": "#f28e2b", "decode": "#4e79a7"}
MARK_COLORS = {"swap": "#d62728", "recompute": "#9467bd"}


def render_png(header: dict, steps: list[dict], path: str) -> None:
    """Write the summary to `path`; ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure

    def bars(ax, x0, x1, y0, y1, color: str, label: str) -> None:
        """Rectangles as one collection: thousands draw in a blink, unlike ax.bar's."""
        verts = [[(a, c), (b, c), (b, d), (a, d)] for a, b, c, d in zip(x0, x1, y0, y1)]
        ax.add_collection(PolyCollection(verts, facecolors=color, linewidths=0, label=label))
        ax.autoscale_view()

    fig = Figure(figsize=(12, 11), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg backend, whatever pyplot's default is
    ax_tok, ax_q, ax_kv, ax_g = fig.subplots(4, 1, sharex=True,
                                             height_ratios=[1, 0.8, 0.8, 1.6])
    t = totals(header, steps)
    fig.suptitle(f"nano-vLLM step trace: {t['steps']:,} steps, {t['wall']:.2f} s, "
                 f"{sum(t['tokens'].values()):,} tokens, {t['arrived']:,} requests, "
                 "preempted " + (", ".join(f"{k} {v}" for k, v in t["preempted"].items()) or "0"))
    if not steps:
        ax_tok.text(0.5, 0.5, "no steps recorded", ha="center", transform=ax_tok.transAxes)
        fig.savefig(path)
        return
    pts = points(steps, t["wall"] or 1.0)
    left, mid = [p.t0 for p in pts], [(p.t0 + p.t1) / 2 for p in pts]
    right = [max(p.t1, p.t0 + t["wall"] / 2000) for p in pts]
    decode, total = [p.decode for p in pts], [p.decode + p.prefill for p in pts]
    bars(ax_tok, left, right, [0] * len(pts), decode, "#4e79a7", "decode")
    bars(ax_tok, left, right, decode, total, "#f28e2b", "prefill")
    ax_tok.set_ylabel("tokens per step")
    ax_q.plot(mid, [p.waiting for p in pts], color="#e15759", label="waiting")
    ax_q.plot(mid, [p.running for p in pts], color="#59a14f", label="running")
    ax_q.set_ylabel("sequences")
    kv = lambda tier, f: [p.kv[tier][f] for p in pts]  # noqa: E731
    ax_kv.stackplot(mid, kv("device", "used"), kv("device", "cached"),
                    colors=["#4e79a7", "#8cd1c9"], labels=["device used", "device cached"])
    if header.get("num_host_blocks"):  # the host tier below zero
        ax_kv.stackplot(mid, [-v for v in kv("host", "used")], [-v for v in kv("host", "cached")],
                        colors=["#b07aa1", "#d4a6c8"], labels=["host used", "host cached"])
        ax_kv.axhline(-header["num_host_blocks"], color="#999", ls="--", lw=0.8)
    ax_kv.axhline(header.get("num_kv_blocks") or 0, color="#999", ls="--", lw=0.8)
    ax_kv.axhline(0, color="#333", lw=0.6)
    ax_kv.set_ylabel("KV blocks (host < 0)")
    all_lanes = lanes(steps, pixel=(t["wall"] or 1.0) / PLOT)
    for kind, color in GANTT_COLORS.items():
        segs = [(i, s) for i, ln in enumerate(all_lanes) for s in ln.segments if s.kind == kind]
        if segs:
            bars(ax_g, [s.t0 for _, s in segs], [s.t1 for _, s in segs],
                 [i - 0.4 for i, _ in segs], [i + 0.4 for i, _ in segs], color, kind)
    for kind, color in MARK_COLORS.items():
        marks = [(t0, i) for i, ln in enumerate(all_lanes) for t0, k, _ in ln.preempted
                 if k == kind]
        if marks:
            ax_g.scatter(*zip(*marks), marker="v", color=color, s=18, zorder=3,
                         label=f"preempted: {kind}")
    ends = [(ln.finished[0], i) for i, ln in enumerate(all_lanes) if ln.finished]
    if ends:
        ax_g.scatter(*zip(*ends), marker="o", color="#2ca02c", s=8, zorder=3, label="finished")
    ax_g.set_ylim(len(all_lanes) - 0.5, -0.5)
    if len(all_lanes) <= 40:
        ax_g.set_yticks(range(len(all_lanes)), [ln.req for ln in all_lanes], fontsize=8)
    ax_g.set_ylabel(f"requests ({len(all_lanes)})")
    ax_g.set_xlabel("wall time (s)")
    for ax in (ax_tok, ax_q, ax_kv, ax_g):
        ax.legend(loc="lower left" if ax is ax_g else "upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.savefig(path)
