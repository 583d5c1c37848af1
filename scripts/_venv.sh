# Sourced by scripts/test and scripts/demo: create or reuse .venv and install the
# project with its test extras. Re-installs only when pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            py="$candidate"
            break
        fi
    done
fi
if [ -z "$py" ]; then
    echo "pccl_trio needs Python 3.11 or newer on PATH (or set PYTHON=...)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
stamp=.venv/.pccl_trio-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    log=.venv/install.log
    echo "setting up .venv (log in $log) ..." >&2
    if ! { .venv/bin/python -m pip install --upgrade pip &&
        .venv/bin/python -m pip install -e '.[test]'; } >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "installing pccl_trio into .venv failed; see $log" >&2
        exit 1
    fi
    touch "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
