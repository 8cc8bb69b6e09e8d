#!/usr/bin/env bash
# Build (or refresh) a test environment with the GPU machines' software stack, and optionally run the suite in it.
#
# The GPU machines compfx is measured on run Python 3.12, torch 2.11.0 (the CUDA 13.0 build that PyPI serves),
# transformers 5.17.0, lightning 2.6.6 and accelerate 1.15.0, without torchao. torch's CUDA build runs on a CPU
# too, so that stack can be rehearsed anywhere: this is the oldest stack pyproject.toml declares, and the suite
# must pass in it as well as in the newest one. Run it (with --test, with and without --torchao) before merging a
# change; the full suite in it takes longer than CI allows beside the main run.
#
#   scripts/gpu_stack_env.sh                 # build or refresh the environment, without torchao
#   scripts/gpu_stack_env.sh --test          # ... then run the whole suite in it
#   scripts/gpu_stack_env.sh --torchao --test  # the same stack plus torchao (FP8), then the suite
#   scripts/gpu_stack_env.sh --test -- -x tests/test_capture.py   # pytest arguments after --
#
# Options: --python PATH (a Python 3.12 interpreter; default: python3.12 on PATH, then pyenv's 3.12.1),
#          --venv DIR (default: $COMPFX_GPU_STACK_VENV, else venvs/gpu-stack in the folder that holds the repository).
# The first build downloads torch's CUDA wheels (several GB); later runs only check the pins.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${COMPFX_GPU_STACK_VENV:-$(dirname "$repo")/venvs/gpu-stack}
python=""
with_torchao=0
run_tests=0
pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --torchao) with_torchao=1 ;;
        --test) run_tests=1 ;;
        --venv) venv=$2; shift ;;
        --python) python=$2; shift ;;
        --) shift; pytest_args=("$@"); break ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# The GPU machines' versions, pinned: this environment exists to run exactly them.
pins=(torch==2.11.0 transformers==5.17.0 lightning==2.6.6 accelerate==1.15.0)
# compfx's own dependencies and its test dependencies (pyproject's [test] extra less torchao), unpinned.
deps=(tabulate tqdm pytest hypothesis scikit-learn networkx)
torchao_pin=torchao==0.18.0

if [ -z "$python" ]; then
    # (a pyenv shim named python3.12 can exist and still fail: try each one)
    for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}/versions/3.12.1/bin/python"; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
            python=$(command -v "$candidate"); break
        fi
    done
fi
[ -n "$python" ] || { echo "no Python 3.12 found: pass --python PATH" >&2; exit 1; }
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
    || { echo "$python is not Python 3.12" >&2; exit 1; }

if [ ! -x "$venv/bin/python" ]; then
    echo "+ creating $venv with $python"
    "$python" -m venv "$venv"
fi
py="$venv/bin/python"
# A machine-wide pip constraint file may cap torch; the pins above are what this environment is for.
export PIP_CONSTRAINT=""
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "${pins[@]}" "${deps[@]}"
if [ "$with_torchao" = 1 ]; then
    # torchao's wheel is built for one torch; against another its C++ kernels do not load (it warns) but the
    # float8 training that compfx uses is Python over torch's scaled matmul.
    "$py" -m pip install -q --no-deps "$torchao_pin"
else
    "$py" -m pip uninstall -q -y torchao 2>/dev/null || true
fi
# compfx itself, editable, without letting pip touch the pins.
"$py" -m pip install -q --no-deps --no-build-isolation -e "$repo"

"$py" - <<'EOF'
import importlib.metadata as md, sys
names = ["torch", "transformers", "lightning", "accelerate", "torchao"]
versions = {}
for name in names:
    try:
        versions[name] = md.version(name)
    except md.PackageNotFoundError:
        versions[name] = "not installed"
print("gpu-stack environment: Python %d.%d.%d, " % sys.version_info[:3] + ", ".join(f"{n} {v}" for n, v in versions.items()))
EOF

if [ "$run_tests" = 1 ]; then
    cd "$repo"
    [ ${#pytest_args[@]} -gt 0 ] || pytest_args=(-q -p no:cacheprovider)
    echo "+ $py -m pytest ${pytest_args[*]}"
    exec "$py" -m pytest "${pytest_args[@]}"
fi
