#!/usr/bin/env bash
# stop-local-cluster.sh [--purge] - stop the cluster of start-local-cluster.sh. Only the daemons
# whose pid files live in $SLURM_LOCAL_DIR/run are signalled, by pid; --purge also removes the
# state folder (and the /etc/slurm/slurm.conf link if it points there).
set -uo pipefail
D=${SLURM_LOCAL_DIR:-/tmp/workbench-slurm}
export SLURM_CONF=$D/etc/slurm.conf
log() { echo "[slurm-local $(date +%T)] $*" >&2; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Job step daemons (slurmstepd) outlive slurmd: cancel our jobs first and let them end.
if alive "$D/run/slurmctld.pid"; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u)
  if [ -n "$jobs" ]; then
    log "cancelling jobs: $(echo $jobs)"
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 100); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi
# slurmd-<node>.pid: one slurmd per node (two on this host); slurmd.pid: the one-node layout
for pf in "$D"/run/slurmd-*.pid "$D"/run/{slurmd,slurmctld,slurmdbd,mysqld,munged}.pid; do
  [ -e "$pf" ] || continue
  name=$(basename "$pf" .pid)
  if alive "$pf"; then
    pid=$(cat "$pf")
    log "stopping $name (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "$name alive after 10 s: KILL"; kill -9 "$pid"; fi
  fi
  rm -f "$pf"
done
# the nodes' namespaces of --nodes N (slurm/nodes.sh): what still runs there, then the network
if ip netns list 2>/dev/null | grep -q '^wbslurm-'; then
  bash "$(dirname "${BASH_SOURCE[0]}")/nodes.sh" down
fi
if [ "${1:-}" = "--purge" ]; then
  if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$D/etc/slurm.conf" ]; then
    rm -f /etc/slurm/slurm.conf
  fi
  rm -rf "${D:?}"
  log "purged $D"
fi
log "stopped"
