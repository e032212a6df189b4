#!/usr/bin/env bash
# The two quick-start commands of the README:
#   ./dev.sh serve [flags]   set everything up, then `loragate serve` (without --model, fetches
#                            and converts the default model SmolLM2-135M-Instruct once into
#                            ~/.cache/loragate/models, like any other dependency)
#   ./dev.sh test            set everything up, then run tests, ruff and mypy
# Needs only Python 3.11+ and pip. Everything goes into ./.venv.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
# CPU machines pin the CPU build of torch; a GPU user installs CUDA torch into .venv first and
# runs with LORAGATE_CONSTRAINTS= (empty) so pip keeps it.
CONSTRAINTS=${LORAGATE_CONSTRAINTS-constraints-cpu.txt}

setup() {
    if [ ! -x .venv/bin/python ]; then
        echo "dev.sh: creating the virtual environment in .venv" >&2
        "$PYTHON" -m venv .venv
    fi
    # Reinstall only when the project's declared dependencies changed.
    local stamp=.venv/.loragate-installed
    local want
    want=$(cat pyproject.toml "${CONSTRAINTS:-/dev/null}" | sha256sum | cut -d' ' -f1)
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        # pip's own progress (no -q): the first install downloads torch and takes minutes.
        local args=(-e '.[dev]')
        [ -n "$CONSTRAINTS" ] && args=(-c "$CONSTRAINTS" "${args[@]}")
        echo "dev.sh: installing loragate and its dependencies into .venv (the first time" \
             "downloads torch: a few minutes)" >&2
        local started=$SECONDS
        .venv/bin/python -m pip install "${args[@]}"
        echo "$want" > "$stamp"
        echo "dev.sh: installed in $((SECONDS - started))s" >&2
    fi
}

cmd=${1:-}
shift || true
case "$cmd" in
    test)
        setup
        echo "dev.sh: ruff" >&2
        .venv/bin/ruff check .
        echo "dev.sh: mypy" >&2
        # Its cache outside the checkout: it checks sources by content, so a fresh clone
        # rechecks only what differs from the last run (a minute cold on 2 cores).
        MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/loragate/mypy} \
            .venv/bin/mypy
        # Two workers (or LORAGATE_TEST_WORKERS; 0 runs in this process): the suite is mostly
        # server processes starting and talking, and one worker leaves a third of two cores
        # idle. A test file runs whole on one worker, so its module's live servers start once.
        workers=${LORAGATE_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}
        echo "dev.sh: pytest ($workers workers)" >&2
        # The workers and the servers they start share the cores: OpenMP threads that spin at
        # barriers wait there for siblings that are not running (benchmarks/RESULTS.md, "OpenMP's
        # wait policy on a shared host"), so they sleep instead unless told otherwise.
        # --durations: the slowest tests, for keeping CI short
        OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} \
            .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --durations=20 "$@"
        ;;
    serve)
        setup
        case " $* " in
            *" --model "*|*" --model="*|*" --help "*|*" -h "*) ;;
            *) .venv/bin/loragate fetch-default-model ;;
        esac
        exec .venv/bin/loragate serve "$@"
        ;;
    *)
        echo "usage: ./dev.sh test [pytest args] | ./dev.sh serve [loragate serve flags]" >&2
        exit 2
        ;;
esac
