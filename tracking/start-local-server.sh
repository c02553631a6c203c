#!/usr/bin/env bash
# start-local-server.sh [ARGS] - start (installing Debian's postgresql when missing) a private
# PostgreSQL and an MLflow tracking server on it, bound to 127.0.0.1 by default; idempotent.
# A thin wrapper of `python -m workbench.track.server start`, whose docstring explains the
# settings. ARGS pass through: --dir (default /tmp/workbench-tracking), --host, --port (5000),
# --pg-port (5433), --workers (2), --auth [--auth-file FILE].
#
# On success: `source /tmp/workbench-tracking/env.sh` exports WORKBENCH_TRACKING_URI,
# WORKBENCH_OPTUNA_STORAGE and PGPASSFILE.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
exec env PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m workbench.track.server start "$@"
