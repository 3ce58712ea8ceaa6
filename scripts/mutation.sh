#!/usr/bin/env bash
# Mutation score of core/, the sampler and output processing (config: [tool.mutmut] in
# pyproject.toml; results and the survivors judged harmless: docs/testing.md).
# Runs mutmut 3 in a throwaway copy of the committed tree, so the checkout is never mutated.
# About an hour on 2 cores; not part of CI. Usage: scripts/mutation.sh [mutant-glob ...]
set -euo pipefail
root=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
python -c 'import mutmut' 2>/dev/null || pip install -q "mutmut==3.8.1"
work=${MUTATION_DIR:-$(mktemp -d)/tree}
[ -d "$work" ] || git -C "$root" worktree add --detach -q "$work" HEAD
cd "$work"
# the scheduler fuzz test draws 300 examples (CI: 1000) to keep each mutant quick
export HYPOTHESIS_EXAMPLES=${HYPOTHESIS_EXAMPLES:-300}
# one torch thread per child: two children of two threads on two cores spin in OpenMP
# barriers and time out tests that take 0.2 s alone
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mutmut run --max-children "${JOBS:-$(nproc)}" "$@" >/dev/null || true
python "$root/scripts/mutation_score.py"
echo "worktree: $work (mutmut show <name> / mutmut browse there; git worktree remove when done)"
