"""What a running server says about itself during a benchmark (benchmarks/serve.py): each
of its processes' CPU time, read from /proc, and its engines' counters, read from /metrics
(steps, and the engine loop's time by phase, which an offline run of the same work reports
too: LLMEngine.timing)."""

import os
import re
from pathlib import Path

import httpx

from nanovllm.engine.step_times import STEP_PHASES


def process_cpu(root: int, log_path: Path | None = None) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of the server's processes, read from /proc: the front end
    (`root`) and every descendant (other front ends, named in the server's log with
    --api-server-count; engine processes; tensor-parallel ranks), by pid, with a name.
    Empty where /proc is missing."""
    log = log_path.read_text(errors="replace") if log_path is not None else ""
    front_ends = {root, *map(int, re.findall(r"front end \d+: process (\d+)", log))}
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += [c for c, p in parents.items() if p == pid]
    out = {}
    for pid in tree:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "resource_tracker" in cmd:
            continue
        name = ("front end" if pid in front_ends else "tensor-parallel rank" if " worker" in cmd
                else "engine process")
        out[pid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def report_server_cpu(before: dict, after: dict, run: dict) -> None:
    """Each server process's busy cores over a run and its CPU time per output token: one
    near a whole core is where a saturated server is bound."""
    tokens = run["output_throughput"] * run["duration_s"]
    parts = []
    for pid, (name, end) in sorted(after.items()):
        used = end - before.get(pid, (name, 0.0))[1]
        parts.append(f"{name} {pid}: {used / run['duration_s']:.2f} cores, "
                     f"{1e6 * used / max(tokens, 1):.1f} us/token")
        run.setdefault("server_cpu", []).append(
            {"process": name, "pid": pid, "cpu_s": used, "cores": used / run["duration_s"]})
    print("       server CPU: " + "; ".join(parts))


LOOP_PHASES = ("idle", "receive", *STEP_PHASES, "send")  # the engine loop's, in order


def engine_counters(base_url: str, headers: dict) -> dict[str, float] | None:
    """The server's engine counters from /metrics, summed over replicas: "steps",
    "prefill_steps" and the engine loop's seconds per phase (LOOP_PHASES); None when it
    does not say."""
    try:
        text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return None
    keys = {"nanovllm:engine_steps_total": "steps",
            "nanovllm:engine_prefill_steps_total": "prefill_steps"}
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = keys.get(name)
        if name == "nanovllm:engine_loop_seconds_total":
            key = line.split('phase="', 1)[1].split('"', 1)[0]
        if name == "nanovllm:engine_gc_seconds_total":
            key = "gc " + line.split('generation="', 1)[1].split('"', 1)[0]
        if name == "nanovllm:generation_tokens_total" and 'replica="' in line:
            key = "tokens of replica " + line.split('replica="', 1)[1].split('"', 1)[0]
        if key is not None:
            found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return found or None


def loop_line(seconds: dict[str, float], wall: float) -> str:
    """Where the engine's wall time went, per phase, out of `wall`; first the time inside
    its steps, which served and offline runs of the same work should share (if they do,
    what the server loses is outside the steps: idle, receiving, sending, or the client)."""
    in_steps = sum(seconds.get(p, 0.0) for p in STEP_PHASES)
    parts = [f"{p} {seconds[p]:.2f}" for p in LOOP_PHASES if p in seconds]
    return f"in steps {in_steps:.2f} s ({', '.join(parts)}) of {wall:.2f} s"


def report_steps(before, after, run: dict) -> None:
    """The engine steps a run took (with the offline run's: whether serving split the same
    work into more, smaller steps) and where the engine process's time went: wait is the
    time the host had nothing to do but wait for the device, so a host-bound engine shows
    little wait and much of the other phases, and a starved one shows idle time."""
    if before is None or after is None:
        return
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    run["engine_steps"], run["engine_prefill_steps"] = delta["steps"], delta["prefill_steps"]
    print(f"       engine steps: {run['engine_steps']:.0f} "
          f"({run['engine_prefill_steps']:.0f} with prompt tokens)")
    shares = {k.rsplit(" ", 1)[1]: v for k, v in delta.items() if k.startswith("tokens of")}
    if len(shares) > 1:  # data parallel: how evenly placement spread the work
        run["tokens_by_replica"] = shares
        even = sum(shares.values()) / len(shares)
        print("       replicas: output tokens " + " / ".join(
            f"{v:,.0f}" for v in shares.values()) + f" (busiest {max(shares.values()) / even:.2f}"
            " of an even share)")
    loop = {p: delta[p] for p in LOOP_PHASES if p in delta}
    if loop:
        run["engine_loop_s"] = loop
        print(f"       engine loop: {loop_line(loop, run['duration_s'])}")
    gc_s = {k[3:]: v for k, v in delta.items() if k.startswith("gc ")}
    if gc_s:  # pauses that stop the engine's thread, steps included
        run["engine_gc_s"] = gc_s
        print(f"       engine gc pauses: full {gc_s.get('2', 0.0):.3f} s, younger "
              f"{gc_s.get('0', 0.0) + gc_s.get('1', 0.0):.3f} s")
