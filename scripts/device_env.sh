# Sourced by the device scripts (repo root): $OUT for logs, the wheels carried in .whl/
# (git-ignored; name `.whl` in the device tool's carry) installed to /tmp/site, and the
# repository on PYTHONPATH. See each script's header for the wheels it needs.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
