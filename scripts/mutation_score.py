"""Summarise a mutmut run (run from its directory): counts per file and the score."""

import collections
import subprocess

lines = subprocess.run(["mutmut", "results", "--all", "true"], capture_output=True, text=True,
                       check=True).stdout.splitlines()
by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
for line in lines:
    name, _, status = line.strip().rpartition(": ")
    if not name:
        continue
    module = name.split(".x")[0].split(".x_")[0]
    by_file[module][status] += 1
total = collections.Counter()
print(f"{'module':45s} {'killed':>7s} {'timeout':>7s} {'survived':>8s} {'other':>6s}")
for module, c in sorted(by_file.items()):
    other = sum(v for k, v in c.items() if k not in ("killed", "timeout", "survived"))
    print(f"{module:45s} {c['killed']:7d} {c['timeout']:7d} {c['survived']:8d} {other:6d}")
    total.update(c)
caught = total["killed"] + total["timeout"]  # a mutant that hangs the tests is caught too
print(f"caught {caught} of {sum(total.values())} mutants "
      f"({100 * caught / max(1, sum(total.values())):.1f}%), {total['survived']} survived; "
      "survivors: mutmut results")
