#!/usr/bin/env bash
# stop-local-server.sh [--dir DIR] - stop what start-local-server.sh started under DIR (default
# /tmp/workbench-tracking): the MLflow server's process group and the PostgreSQL cluster of
# DIR/pg, each by the pid it recorded. The data stays; remove DIR to start afresh.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
exec env PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m workbench.track.server stop "$@"
