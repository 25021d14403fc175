#!/usr/bin/env bash
# Create ./.venv and install megatron_harts into it (editable, with its test, bench and plot extras: bench
# brings OR-Tools, so the planner baseline that uses it is tested too), compiling the C++ planner core
# (csrc/*.cpp -> megatron_harts/_C).  One line per step on stdout; pip itself stays quiet.
#
# Does no work when nothing changed: .venv/.harts-install holds a hash of what the install depends on
# (setup.py, pyproject.toml, the torch version, the extras) and .venv/.harts-core a hash of the C++
# sources (csrc/*, setup.py).  When both match and the venv imports this checkout's megatron_harts._C,
# no pip runs; a change to csrc/ alone recompiles the core without reinstalling the dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=2.13.0
EXTRAS=test,bench,plot
VPY=.venv/bin/python
PIP=("$VPY" -m pip install -q --disable-pip-version-check)
INSTALL_STAMP=.venv/.harts-install
CORE_STAMP=.venv/.harts-core

did=0
say() { echo "setup: $*"; }

# step LABEL CMD...: runs CMD after a line saying what it does, and a line every 30 s while it runs
# (pip's notices about configured index folders that do not exist are left out of its stderr)
step() {
  local label=$1 pid t=0
  shift
  did=1
  say "$label"
  "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" >&2) &
  pid=$!
  trap 'kill "$pid" 2> /dev/null' INT TERM
  while kill -0 "$pid" 2> /dev/null; do
    sleep 1
    t=$((t + 1))
    if (( t % 30 == 0 )) && kill -0 "$pid" 2> /dev/null; then say "  ... $t s"; fi
  done
  trap - INT TERM
  wait "$pid"
}

digest() { sha256sum "$@" | sha256sum | cut -d' ' -f1; }

install_hash=$( { echo "torch $TORCH extras $EXTRAS"; digest setup.py pyproject.toml; } | sha256sum | cut -d' ' -f1)
core_hash=$(digest setup.py csrc/*)

# the venv imports this checkout's package and its compiled core
core_imports() {
  "$VPY" - 2> /dev/null << 'EOF'
import os
import megatron_harts._C
import megatron_harts
assert os.path.samefile(os.path.dirname(megatron_harts.__file__), "megatron_harts")
EOF
}

if [ ! -x "$VPY" ]; then
  step "creating .venv" "$PY" -m venv .venv
fi

if [ "$(cat "$INSTALL_STAMP" 2> /dev/null)" != "$install_hash" ]; then
  have=$("$VPY" -c "import importlib.metadata as m; print(m.version('torch'))" 2> /dev/null || true)
  if [ "${have%%+*}" != "$TORCH" ]; then
    # the CPU build of torch first, so that no dependency pulls a CUDA build
    step "installing torch $TORCH (CPU)" "${PIP[@]}" "torch==$TORCH"
  fi
  step "installing megatron_harts and its ${EXTRAS//,//} extras, compiling the C++ planner core (2-5 min)" \
    "${PIP[@]}" -e ".[$EXTRAS]"
  echo "$install_hash" > "$INSTALL_STAMP"
  echo "$core_hash" > "$CORE_STAMP"
elif [ "$(cat "$CORE_STAMP" 2> /dev/null)" != "$core_hash" ] || ! core_imports; then
  step "compiling the C++ planner core (2-5 min)" "${PIP[@]}" --no-deps -e .
  echo "$core_hash" > "$CORE_STAMP"
fi

if ! core_imports; then
  echo "error: .venv does not import megatron_harts._C from this checkout after the install" >&2
  exit 2
fi
if [ "$did" = 0 ]; then say "up to date (.venv)"; else say "done (.venv)"; fi
