#!/usr/bin/env bash
# jaxpar quick start. Creates (or reuses) .venv with the pinned dependencies, then:
#   bash run.sh train [key=value ...]   train the default model on 8 emulated CPU devices (data=4 x tensor=2)
#   bash run.sh test  [pytest args ...] run the whole test suite
#   bash run.sh jaxpar ...              any jaxpar command inside the environment
set -euo pipefail
cd "$(dirname "$0")"

python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1; then python_bin="$candidate"; break; fi
  done
fi
if ! "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "run.sh: jaxpar needs Python 3.11 or newer; set PYTHON=/path/to/python3.11." >&2
  exit 2
fi

venv=.venv
stamp="$venv/.jaxpar-install"
wanted="$(cat requirements.lock pyproject.toml | "$python_bin" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ ! -x "$venv/bin/python" ]; then
  echo "run.sh: creating $venv with $("$python_bin" --version)" >&2
  "$python_bin" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  echo "run.sh: installing pinned dependencies (requirements.lock) into $venv" >&2
  "$venv/bin/python" -m pip install --disable-pip-version-check -q -r requirements.lock
  "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps -e .
  echo "$wanted" > "$stamp"
fi

command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
  train) exec "$venv/bin/jaxpar" train configs/default.yaml "$@" ;;
  test) exec "$venv/bin/python" -m pytest -q "$@" ;;
  jaxpar) exec "$venv/bin/jaxpar" "$@" ;;
  *) echo "usage: bash run.sh train|test|jaxpar [arguments]" >&2; exit 2 ;;
esac
