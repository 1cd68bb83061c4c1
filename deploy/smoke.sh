#!/usr/bin/env bash
# One command: build the image offline, deploy it with compose, ask it, kill its executor, tear it
# down; prints each step, the times and the image size (deploy/smoke.py). Needs a Docker engine,
# compose and the project's virtualenv (./dev setup) for the openai client. Exit 0: every check
# passed; 1: one failed; 2: it could not run here (and says why).
#   deploy/smoke.sh [--no-build] [--image pagedserve:cpu] [--port N] [--frontends 2] [--requests 20] [--curve zmq-keys]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || { echo "smoke: no $PYTHON: run ./dev setup (or set PYTHON)" >&2; exit 2; }
exec "$PYTHON" deploy/smoke.py "$@"
