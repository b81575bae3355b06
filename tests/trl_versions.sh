#!/usr/bin/env bash
# The checks of `covey verify --trl` (tests/test_verify_trl.py) against each TRL release given, or every 1.x
# release on PyPI: one environment, TRL swapped in place. Prints one line per release.
#   tests/trl_versions.sh [VERSION ...]        (make trl-versions)
set -u
VENV=${VENV:-.venv-trl}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    $PYTHON -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet "torch==${TORCH_VERSION:-2.13.0}"
    "$VENV/bin/pip" install --quiet -e ".[dev]"
fi
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    versions=($("$VENV/bin/pip" index versions trl 2>/dev/null | sed -n 's/^Available versions: //p' | tr -d ',' \
               | tr ' ' '\n' | grep '^1\.' | sort -V))
fi
for v in "${versions[@]}"; do
    if ! "$VENV/bin/pip" install --quiet --no-deps "trl==$v" >/dev/null 2>&1; then
        echo "trl $v: could not be installed"; continue
    fi
    summary=$(COVEY_TRL_SWEEP=1 HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest tests/test_verify_trl.py -q -p no:randomly 2>&1 | tail -1)
    echo "trl $v: $summary"
done
