#!/usr/bin/env bash
# jaxpar quick start. Creates (or reuses) .venv with the pinned dependencies, then:
#   bash run.sh train [key=value ...]   train the default model on 8 emulated CPU devices (data=4 x tensor=2)
#   bash run.sh test  [pytest args ...] lint (ruff), install the CUDA plugin for plan --target into .gpu-plan/
#                                       (once), then run the whole test suite (-m "not slow": the quick tier)
#   bash run.sh jaxpar ...              any jaxpar command inside the environment
# PYTHON=/path/to/python3.12 picks the interpreter; otherwise the first one that really runs
# and is 3.12 or newer is taken from PATH, then from the usual install places (pyenv, /usr/local).
set -euo pipefail
cd "$(dirname "$0")"

runs_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

python_bin="${PYTHON:-}"
if [ -n "$python_bin" ]; then
  if ! runs_312 "$python_bin"; then
    echo "run.sh: PYTHON=$python_bin does not run as Python 3.12 or newer." >&2
    exit 2
  fi
else
  # A pyenv shim is on PATH even where its version is not selected, and then fails when run:
  # so each candidate is tried, not merely looked up.
  for candidate in python3.13 python3.12 python3 python \
      "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[3-9]*/bin/python3 \
      "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 \
      /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9] /opt/*/bin/python3.1[2-9]; do
    if runs_312 "$candidate"; then python_bin="$candidate"; break; fi
  done
  if [ -z "$python_bin" ]; then
    echo "run.sh: jaxpar needs Python 3.12 or newer and found none on PATH or in pyenv's versions; install one or set PYTHON=/path/to/python3.12." >&2
    exit 2
  fi
fi

venv=.venv
stamp="$venv/.jaxpar-install"
wanted="$(cat requirements.lock pyproject.toml | "$python_bin" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ -x "$venv/bin/python" ] && ! runs_312 "$venv/bin/python"; then
  echo "run.sh: $venv was made with an older Python; recreating it" >&2
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "run.sh: creating $venv with $("$python_bin" --version) ($python_bin)" >&2
  "$python_bin" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  echo "run.sh: installing pinned dependencies (requirements.lock) into $venv" >&2
  "$venv/bin/python" -m pip install --disable-pip-version-check -q -r requirements.lock
  "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps -e .
  echo "$wanted" > "$stamp"
fi

# The CUDA plugin for `jaxpar plan --target` (jaxpar[gpu-plan], ~470 MB) goes into .gpu-plan/, apart from
# .venv, so that `train` and the library never see it; the tests put it on PYTHONPATH (tests/test_gpu_plan.py).
gpu_plan=.gpu-plan
gpu_plan_stamp="$gpu_plan/.jaxpar-install"
gpu_plan_wanted="jax-cuda12-plugin==0.12.0.1 jax-cuda12-pjrt==0.12.0.1"
install_gpu_plan() {
  if [ "$(cat "$gpu_plan_stamp" 2>/dev/null)" != "$gpu_plan_wanted" ]; then
    echo "run.sh: installing the CUDA plugin for plan --target ($gpu_plan_wanted) into $gpu_plan" >&2
    rm -rf "$gpu_plan"
    # shellcheck disable=SC2086  # the two requirements, split
    "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps --target "$gpu_plan" $gpu_plan_wanted
    echo "$gpu_plan_wanted" > "$gpu_plan_stamp"
  fi
}

command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
  train) exec "$venv/bin/jaxpar" train configs/default.yaml "$@" ;;
  test) "$venv/bin/ruff" check . && install_gpu_plan && JAXPAR_GPU_PLAN=required exec "$venv/bin/python" -m pytest -q "$@" ;;
  jaxpar) exec "$venv/bin/jaxpar" "$@" ;;
  *) echo "usage: bash run.sh train|test|jaxpar [arguments]" >&2; exit 2 ;;
esac
