#!/usr/bin/env bash
# start-local-cluster.sh [--nodes N] [--link-mbit R] - install (when missing), configure and
# start a real Slurm cluster on this machine: munged + slurmctld + slurmd (+ slurmdbd and a
# private MariaDB for accounting, which `sacct` and therefore submitit's job states need). No
# cgroups, state under one folder. Idempotent: a second run only checks the daemons and waits
# for the nodes. Needs root (it starts daemons as root and may apt-get install).
#
# --nodes 1 (the default): two slurmds on loopback, one per partition (debug, pool2).
# --nodes N (N >= 2): N compute nodes node1..nodeN, each a slurmd in its own network and UTS
#   namespace with its own address on a virtual network (10.78.0.0/24) whose head, 10.78.0.1,
#   runs slurmctld (slurm/nodes.sh); partitions debug (every node, the default) and pool2
#   (node2). --link-mbit R limits every node's NIC to R Mbit/s both ways (0: unlimited).
#   Without --nodes, a running cluster keeps its node count.
#
# Knobs (environment, all optional):
#   SLURM_LOCAL_DIR    state, config, logs, pid files     (default /tmp/workbench-slurm)
#   SLURM_AUTH         munge | none                       (default munge)
#   SLURM_ACCOUNTING   1: slurmdbd + MariaDB (sacct works); 0: none   (default 1)
#   SLURM_NODE_CPUS    CPUs the node advertises           (default: nproc)
#   SLURM_NODE_MEM_MB  RealMemory of the node             (default: from slurmd -C)
#   SLURM_LINK_ETC     1: link /etc/slurm/slurm.conf to the generated one  (default 1)
#   SLURM_FRESH        1: wipe job state + accounting before starting      (default 0)
#   SLURM_WAIT_S       seconds to wait for the node to become idle         (default 60)
#
# On success: `source $SLURM_LOCAL_DIR/env.sh` (exports SLURM_CONF); `sinfo` shows it idle.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
D=${SLURM_LOCAL_DIR:-/tmp/workbench-slurm}
NODES="" LINK_MBIT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES=${2:-}; shift 2 || shift ;;
    --nodes=*) NODES=${1#*=}; shift ;;
    --link-mbit) LINK_MBIT=${2:-}; shift 2 || shift ;;
    --link-mbit=*) LINK_MBIT=${1#*=}; shift ;;
    *) echo "start-local-cluster.sh: unknown argument '$1' (valid: --nodes N, --link-mbit R)" >&2
       exit 2 ;;
  esac
done
running=0  # a running cluster keeps its shape: its node count and link rate
if [ -s "$D/run/slurmctld.pid" ] && kill -0 "$(cat "$D/run/slurmctld.pid")" 2>/dev/null; then
  running=1
fi
if [ -z "$NODES" ]; then
  NODES=1
  if [ "$running" = 1 ] && [ -s "$D/etc/nodes" ]; then NODES=$(cat "$D/etc/nodes"); fi
fi
if [ -z "$LINK_MBIT" ]; then
  LINK_MBIT=0
  if [ "$running" = 1 ] && [ -s "$D/etc/link_mbit" ]; then LINK_MBIT=$(cat "$D/etc/link_mbit"); fi
fi
case "$NODES" in ''|*[!0-9]*|0) echo "start-local-cluster.sh: --nodes must be a whole number >= 1, not '$NODES'" >&2; exit 2 ;; esac
[ "$NODES" -le 64 ] || { echo "start-local-cluster.sh: --nodes must be at most 64, not $NODES" >&2; exit 2; }
case "$LINK_MBIT" in ''|*[!0-9.]*) echo "start-local-cluster.sh: --link-mbit must be a number of Mbit/s (0: unlimited), not '$LINK_MBIT'" >&2; exit 2 ;; esac
AUTH=${SLURM_AUTH:-munge}
ACCT=${SLURM_ACCOUNTING:-1}
LINK_ETC=${SLURM_LINK_ETC:-1}
FRESH=${SLURM_FRESH:-0}
WAIT_S=${SLURM_WAIT_S:-60}
NODE=$(hostname -s)
DB_PORT=3307 DBD_PORT=6819 CTLD_PORT=6817 SLURMD_PORT=6818 SLURMD2_PORT=6820
NODE2=$NODE-pool2   # one node: a second slurmd on this host for partition pool2
if [ "$NODES" = 1 ]; then
  CTLD_ADDR=127.0.0.1
  COMPUTE=("$NODE" "$NODE2")
  # Two partitions, each with a node of its own: `debug` (the default) and `pool2` (a second
  # slurmd on this same host). A cluster made of pools (cluster.pools[*].partition) is launched
  # as ONE heterogeneous job with one component per partition (workbench/launch/hetjob.py). Two
  # slurmds, not one node in both partitions: Slurm's backfill scheduler, the only one that
  # starts heterogeneous jobs, plans whole nodes, so two components never start on one node
  # (tried: they pend on Resources forever).
  NODE_LINES="NodeName=$NODE NodeAddr=127.0.0.1 CPUs=@CPUS@ RealMemory=@MEM_MB@ State=UNKNOWN
NodeName=$NODE2 NodeHostname=$NODE NodeAddr=127.0.0.1 Port=$SLURMD2_PORT CPUs=@CPUS@ RealMemory=@MEM_MB@ State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=pool2 Nodes=$NODE2 Default=NO MaxTime=INFINITE State=UP"
else
  CTLD_ADDR=10.78.0.1   # the head's address on the nodes' network (slurm/nodes.sh)
  COMPUTE=()
  NODE_LINES=""
  for k in $(seq "$NODES"); do
    COMPUTE+=("node$k")
    NODE_LINES+="NodeName=node$k NodeAddr=10.78.0.$((10 + k)) CPUs=@CPUS@ RealMemory=@MEM_MB@ State=UNKNOWN
"
  done
  # debug: every node (multi-node jobs, arrays); pool2: node2 (a pooled run's second component)
  NODE_LINES+="PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP
PartitionName=pool2 Nodes=node2 Default=NO MaxTime=INFINITE State=UP"
fi

log() { echo "[slurm-local $(date +%T)] $*" >&2; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
t0=$SECONDS

# ------------------------------------------------------------------ install what is missing
pkgs=(slurmctld slurmd slurm-client)
[ "$AUTH" = munge ] && pkgs+=(munge)
[ "$ACCT" = 1 ] && pkgs+=(slurmdbd mariadb-server)
[ "$NODES" -gt 1 ] && pkgs+=(iproute2)   # ip netns, veth, bridge, tc (slurm/nodes.sh)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  # Without systemd, the packages' postinst cannot start services: we start them below.
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# ------------------------------------------------------------------ hostname must resolve
# slurmd takes its NodeName from the short hostname; srun resolves it too.
if ! getent hosts "$NODE" >/dev/null 2>&1; then
  log "mapping $NODE to 127.0.0.1 in /etc/hosts"
  echo "127.0.0.1 $NODE" >> /etc/hosts
fi

mkdir -p "$D"/{etc,state,spool,log,run,munge,mysql}
chmod 755 "$D" "$D/run"
if [ "$FRESH" = 1 ] && ! alive "$D/run/slurmctld.pid"; then
  log "SLURM_FRESH=1: wiping job state and accounting"
  rm -rf "${D:?}"/state/* "${D:?}"/spool/* "${D:?}/mysql"
  mkdir -p "$D/mysql"
fi

# ------------------------------------------------------------------ render the configs
CPUS=${SLURM_NODE_CPUS:-$(nproc)}
MEM_MB=${SLURM_NODE_MEM_MB:-$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)}
MEM_MB=${MEM_MB:-$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)}

if [ "$AUTH" = munge ]; then
  # cred_expire=10: a requeued job otherwise waits 120 s before it may start again.
  AUTH_LINES="AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/run/munge.socket,cred_expire=10"
  ACCT_PASS="AccountingStoragePass=$D/run/munge.socket"   # slurmctld -> slurmdbd socket
  DBD_AUTH="AuthType=auth/munge
AuthInfo=socket=$D/run/munge.socket"
else
  AUTH_LINES="AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10"
  ACCT_PASS=""
  DBD_AUTH="AuthType=auth/none"
fi
if [ "$ACCT" = 1 ]; then
  ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
$ACCT_PASS
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
  ACCT_LINES="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi

render() {  # render TEMPLATE: fill every @NAME@ placeholder (values may span lines)
  local t
  t=$(<"$1")
  t=${t//@NODE_LINES@/$NODE_LINES}; t=${t//@CTLD_ADDR@/$CTLD_ADDR}
  t=${t//@NODE@/$NODE}; t=${t//@DIR@/$D}; t=${t//@CPUS@/$CPUS}; t=${t//@MEM_MB@/$MEM_MB}
  t=${t//@CTLD_PORT@/$CTLD_PORT}; t=${t//@SLURMD_PORT@/$SLURMD_PORT}; t=${t//@SLURMD2_PORT@/$SLURMD2_PORT}
  t=${t//@DBD_PORT@/$DBD_PORT}; t=${t//@DB_PORT@/$DB_PORT}
  t=${t//@AUTH_LINES@/$AUTH_LINES}; t=${t//@ACCT_LINES@/$ACCT_LINES}; t=${t//@DBD_AUTH@/$DBD_AUTH}
  printf '%s\n' "$t"
}
new_conf=$(render "$HERE/slurm.conf.in")
conf_changed=0
if [ ! -f "$D/etc/slurm.conf" ] || [ "$new_conf" != "$(cat "$D/etc/slurm.conf")" ]; then
  printf '%s\n' "$new_conf" > "$D/etc/slurm.conf"
  conf_changed=1
fi
render "$HERE/slurmdbd.conf.in" > "$D/etc/slurmdbd.conf"
chmod 600 "$D/etc/slurmdbd.conf"   # slurmdbd refuses a readable one; it sits beside slurm.conf
export SLURM_CONF=$D/etc/slurm.conf
echo "export SLURM_CONF=$SLURM_CONF" > "$D/env.sh"

if [ "$LINK_ETC" = 1 ]; then
  mkdir -p /etc/slurm
  if [ -L /etc/slurm/slurm.conf ] || [ ! -e /etc/slurm/slurm.conf ]; then
    ln -sfn "$SLURM_CONF" /etc/slurm/slurm.conf
  else
    log "note: /etc/slurm/slurm.conf is a real file; left alone (export SLURM_CONF)"
  fi
fi

stop_pid() {  # stop_pid PIDFILE: TERM the daemon named by its pid file and wait for it
  local pid
  alive "$1" || return 0
  pid=$(cat "$1"); kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
}
if [ "$conf_changed" = 1 ]; then
  # slurmd.pid: the pid file of the one-slurmd layout before the second partition's node
  for pf in "$D"/run/slurmd*.pid "$D/run/slurmctld.pid"; do
    if alive "$pf"; then log "config changed: restarting $(basename "$pf" .pid)"; fi
    stop_pid "$pf"
  done
fi

# ------------------------------------------------------------------ munge
if [ "$AUTH" = munge ]; then
  [ -s "$D/munge/munge.key" ] || mungekey -c -k "$D/munge/munge.key"   # mode 0600
  if ! alive "$D/run/munged.pid"; then
    log "starting munged"
    munged --key-file="$D/munge/munge.key" --socket="$D/run/munge.socket" \
      --pid-file="$D/run/munged.pid" --log-file="$D/log/munged.log" \
      --seed-file="$D/munge/munged.seed" --num-threads=4
  fi
  for _ in $(seq 50); do
    munge -S "$D/run/munge.socket" -n 2>/dev/null | unmunge -S "$D/run/munge.socket" >/dev/null 2>&1 && break
    sleep 0.1
  done
fi

# ------------------------------------------------------------------ accounting
if [ "$ACCT" = 1 ]; then
  if [ ! -d "$D/mysql/mysql" ]; then
    log "initialising the MariaDB datadir"
    mariadb-install-db --no-defaults --datadir="$D/mysql" --user=root \
      --auth-root-authentication-method=normal --skip-test-db > "$D/log/mariadb-install.log" 2>&1
  fi
  if ! alive "$D/run/mysqld.pid"; then
    log "starting MariaDB on 127.0.0.1:$DB_PORT"
    setsid mariadbd --no-defaults --datadir="$D/mysql" --user=root \
      --bind-address=127.0.0.1 --port=$DB_PORT --socket="$D/run/mysqld.sock" \
      --pid-file="$D/run/mysqld.pid" --log-error="$D/log/mariadb.err" \
      --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
      < /dev/null > /dev/null 2>&1 &
  fi
  for _ in $(seq 150); do
    mariadb-admin --no-defaults --socket="$D/run/mysqld.sock" ping >/dev/null 2>&1 && break
    sleep 0.2
  done
  mariadb --no-defaults --socket="$D/run/mysqld.sock" -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  if ! alive "$D/run/slurmdbd.pid"; then
    log "starting slurmdbd"
    slurmdbd
  fi
  for _ in $(seq 100); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.2; done
fi

# ------------------------------------------------------------------ slurm daemons
if ! alive "$D/run/slurmctld.pid"; then log "starting slurmctld"; slurmctld -f "$SLURM_CONF"; fi
if [ "$NODES" -gt 1 ]; then
  # the loopback layout's nodes, if any ran before, are not in this config
  for n in "$NODE" "$NODE2"; do stop_pid "$D/run/slurmd-$n.pid"; done
  bash "$HERE/nodes.sh" up "$NODES" "$LINK_MBIT"
else
  for pf in "$D"/run/slurmd-node*.pid; do [ -e "$pf" ] && stop_pid "$pf"; done
  bash "$HERE/nodes.sh" down
fi
echo "$NODES" > "$D/etc/nodes"
echo "$LINK_MBIT" > "$D/etc/link_mbit"
for n in "${COMPUTE[@]}"; do
  if ! alive "$D/run/slurmd-$n.pid"; then
    log "starting slurmd $n"
    if [ "$NODES" = 1 ]; then slurmd -f "$SLURM_CONF" -N "$n"; else bash "$HERE/nodes.sh" start "$n"; fi
  fi
done

usable() {  # usable NODE: its state lets jobs start (node_state NODE prints it)
  case "$(sinfo -h -N -n "$1" -o %T 2>/dev/null | head -1)" in idle|mixed|allocated) ;; *) return 1 ;; esac
}
node_state() { sinfo -h -N -n "$1" -o %T 2>/dev/null | head -1; }
for _ in $(seq $((WAIT_S * 2))); do
  all=1
  for n in "${COMPUTE[@]}"; do usable "$n" || all=0; done
  [ "$all" = 1 ] && break
  for n in "${COMPUTE[@]}"; do
    case "$(node_state "$n")" in
      down*|drain*) scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true ;;
    esac
  done
  sleep 0.5
done
for n in "${COMPUTE[@]}"; do
  if ! usable "$n"; then
    log "node $n did not become idle (state '$(node_state "$n")'); logs in $D/log/"
    sinfo -R || true; exit 1
  fi
done
state=$(node_state "${COMPUTE[0]}")
log "cluster up in $((SECONDS - t0)) s: nodes ${COMPUTE[*]} $state (partition debug: ${COMPUTE[0]}$([ "$NODES" = 1 ] || echo "..node$NODES"), pool2: ${COMPUTE[1]}), $CPUS CPUs and ${MEM_MB} MB each; export SLURM_CONF=$SLURM_CONF"
