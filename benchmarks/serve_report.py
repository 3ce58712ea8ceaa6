"""The serving benchmark's report (benchmarks/serve.py): a table row per request rate, a PNG
of the latency percentiles and throughput against the rate, and the saturated server's
throughput against offline's."""

import math
from pathlib import Path


def print_table(runs: list[dict]) -> None:
    head = f"{'rate':>6} {'ok':>5} {'req/s':>7} {'tok/s':>8}"
    for m in ("ttft", "itl", "tpot", "e2e"):
        head += f" | {m + ' p50/p90/p99 ms':>26}"
    print(head)
    for r in runs:
        line = f"{r['rate']!s:>6} {r['completed']:>5} {r['request_throughput']:>7.2f} "
        line += f"{r['output_throughput']:>8.1f}"
        for m in ("ttft", "itl", "tpot", "e2e"):
            p = r[f"{m}_ms"]
            cells = "/".join("-" if p[k] is None else f"{p[k]:.0f}" for k in ("p50", "p90", "p99"))
            line += f" | {cells:>26}"
        print(line)
        if r["failed"]:
            print(f"       {r['failed']} failed: {r['errors']}")
        if r["wrong_length"]:
            print(f"       {r['wrong_length']} responses had a different length than asked")
        if r["client_cpu_frac"] > 0.8:
            print(
                f"       warning: a client process used {r['client_cpu_frac']:.0%} of a core; "
                "its overhead may limit these figures (try --client-procs)"
            )


def plot(runs: list[dict], path: Path, title: str, offline: dict | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is missing; pip install matplotlib (or -e '.[bench]')")
        return
    xs = list(range(len(runs)))
    labels = [str(r["rate"]) for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (metric, name) in zip(
        axes, [("ttft_ms", "TTFT"), ("itl_ms", "inter-token latency"), ("e2e_ms", "end to end")]
    ):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [r[metric][q] for r in runs], style, label=q)
        ax.set_title(f"{name} (ms)")
        ax.set_yscale("log")
        ax.legend()
    ax = axes[3]
    ax.plot(xs, [r["output_throughput"] for r in runs], "o-", label="server")
    if offline:
        offline_tps = offline["output_throughput"]
        ax.axhline(offline_tps, color="gray", ls="--", label="offline LLM.generate")
    ax.set_title("output tokens/s")
    ax.legend()
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and coefficient of variation (sample standard deviation / mean) of repeated runs."""
    n = len(values)
    mean = sum(values) / n
    if n < 2 or mean == 0:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, var**0.5 / mean


def runs_to_resolve(cv_a: float, cv_b: float, change: float = 0.05) -> int:
    """Runs of each side so that the 95% interval of the ratio of their means is within
    +-change/2: then a `change` between two commits stands out of the noise. Ratio of means,
    log scale: its standard error is sqrt(cv_a^2 + cv_b^2) / sqrt(n)."""
    return max(1, math.ceil((1.96 * math.hypot(cv_a, cv_b) / (change / 2)) ** 2))


def print_ratio(server: list[float], offline: list[float], goal: float) -> dict:
    """Saturated server against offline throughput, best/best and mean/mean, with how many
    runs of each this host needs to see a 5% change. Returns the figures for the report."""
    best = max(server) / max(offline)
    (ms, cs), (mo, co) = spread(server), spread(offline)
    out = {"best_over_best": best, "mean_over_mean": ms / mo, "server_cv": cs,
           "offline_cv": co}
    verdict = "meets" if best >= goal else "does NOT meet"
    print(f"server at rate inf / offline throughput: best/best {best:.3f}, mean/mean "
          f"{ms / mo:.3f} ({verdict} the {goal:g} goal)")
    if len(server) > 1 and len(offline) > 1:
        n = runs_to_resolve(cs, co)
        out["runs_for_5pct"] = n
        print(f"run-to-run spread: server {cs:.1%}, offline {co:.1%} (coefficient of "
              f"variation over {len(server)} / {len(offline)} runs): {n} runs of each to see "
              f"a 5% change")
    return out
