#!/usr/bin/env bash
# nodes.sh - the compute nodes of a multi-node local cluster (start-local-cluster.sh --nodes N):
# each node is a network namespace `wbslurm-nodeK` with one NIC (`eth0`, 10.78.0.(10+K)) plugged
# into a bridge `wbslurm0` (10.78.0.1, the head: slurmctld, slurmdbd, the tracking server) and a
# hostname of its own (a UTS namespace per slurmd), so a job's ranks on two nodes talk over a real
# network path between two addresses, as on a cluster, and never over loopback.
#
#   nodes.sh up N [MBIT]     build the network of N nodes; MBIT > 0 limits each node's NIC, both
#                            directions (tc tbf), as a cluster's inter-node link
#   nodes.sh start NODE      start NODE's slurmd inside its namespace (needs SLURM_CONF)
#   nodes.sh lose NODE       the node dies: SIGKILL every process in its namespace (its slurmd,
#                            slurmstepd, the job's ranks); the network stays, so `start` revives it
#   nodes.sh cut NODE        the node's link goes down (its processes run on, unreachable: a
#                            switch port or cable lost); `nodes.sh join NODE` brings it back
#   nodes.sh down            kill every node's processes and remove the namespaces and the bridge
#   nodes.sh pids NODE       the processes running on NODE
#
# Names resolve through /etc/netns/<ns>/hosts (bound over /etc/hosts in the node's own mount
# namespace) on the nodes and a marked block of /etc/hosts on the head. Private addresses only; needs root.
set -euo pipefail
BRIDGE=wbslurm0 NS_PREFIX=wbslurm- NET=10.78.0 MARK="# workbench-slurm nodes"
HEAD_ADDR=$NET.1

log() { echo "[slurm-nodes $(date +%T)] $*" >&2; }
node_addr() { echo "$NET.$((10 + ${1#node}))"; }
ns_of() { echo "$NS_PREFIX$1"; }
our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^$NS_PREFIX" || true; }

shape() {  # shape NS DEV MBIT: a token bucket at the rate, 50 ms of queue
  local ns_args=()
  [ "$1" = - ] || ns_args=(-n "$1")
  tc "${ns_args[@]}" qdisc replace dev "$2" root tbf rate "${3}mbit" burst 256kb latency 50ms
}

node_lines() {  # node_lines N: every node's address and name (the head's /etc/hosts block)
  for k in $(seq "$1"); do echo "$(node_addr "node$k") node$k $MARK"; done
}

set_head_hosts() {  # rewrite /etc/hosts in place (it may be a bind mount: no rename)
  # only when it changes: a rewrite truncates the file first, and a process resolving a name
  # at that instant (a local run's rendezvous, while the idempotent start runs again) finds none
  local keep
  keep=$(grep -v -- "$MARK" /etc/hosts || true)
  { printf '%s\n' "$keep"; [ -z "${1:-}" ] || printf '%s\n' "$1"; } > /etc/hosts.wbslurm
  if ! cmp -s /etc/hosts.wbslurm /etc/hosts; then cat /etc/hosts.wbslurm > /etc/hosts; fi
  rm -f /etc/hosts.wbslurm
}

up() {
  local n=$1 mbit=${2:-0} ns
  ip link show "$BRIDGE" >/dev/null 2>&1 || {
    ip link add "$BRIDGE" type bridge
    ip addr add "$HEAD_ADDR/24" dev "$BRIDGE"
  }
  ip link set "$BRIDGE" up
  for k in $(seq "$n"); do
    ns=$(ns_of "node$k")
    if ! ip netns list | grep -q "^$ns\b"; then
      ip netns add "$ns"
      ip link add "wbsn$k" type veth peer name eth0 netns "$ns"
      ip link set "wbsn$k" master "$BRIDGE"
      ip link set "wbsn$k" up
      ip -n "$ns" addr add "$(node_addr "node$k")/24" dev eth0
      ip -n "$ns" link set eth0 up
      ip -n "$ns" link set lo up
    fi
    if [ "$mbit" != 0 ]; then  # what the node sends, and what it receives
      shape "$ns" eth0 "$mbit"; shape - "wbsn$k" "$mbit"
    else
      tc -n "$ns" qdisc del dev eth0 root 2>/dev/null || true
      tc qdisc del dev "wbsn$k" root 2>/dev/null || true
    fi
    mkdir -p "/etc/netns/$ns"
    # on a node, this machine's own name is the head: its services are reached there
    { echo "127.0.0.1 localhost"; echo "$HEAD_ADDR $(hostname) $(hostname -s) head"
      node_lines "$n"; } > "/etc/netns/$ns/hosts"
  done
  set_head_hosts "$(node_lines "$n")"
  log "network up: head $HEAD_ADDR, nodes node1..node$n (${mbit:-0} Mbit/s per NIC; 0: unlimited)"
}

start() {  # slurmd daemonizes inside the node's network, UTS and mount namespaces
  # Not `ip netns exec`: it mounts a fresh /sys without /sys/fs/cgroup, and slurmd will not start
  # without it. The node's hosts file is bound over /etc/hosts in a mount namespace of its own.
  local node=$1 ns
  ns=$(ns_of "$node")
  nsenter --net="/var/run/netns/$ns" unshare --uts --mount --propagation private sh -c \
    "mount --bind /etc/netns/$ns/hosts /etc/hosts && hostname $node && exec slurmd -f '$SLURM_CONF' -N $node"
}

pids() { ip netns pids "$(ns_of "$1")" 2>/dev/null || true; }

lose() {
  local p
  p=$(pids "$1")
  [ -z "$p" ] || kill -9 $p 2>/dev/null || true
  for _ in $(seq 50); do [ -z "$(pids "$1")" ] && break; sleep 0.1; done
  log "$1 lost: every process in its namespace killed"
}

link() {  # link NODE up|down: the node's port on the bridge
  ip link set "wbsn${1#node}" "$2"
  log "$1: link $2"
}

down() {
  local ns k
  for ns in $(our_namespaces); do
    lose "${ns#"$NS_PREFIX"}" 2>/dev/null
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  for k in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed -n 's/^\(wbsn[0-9]*\)@.*/\1/p'); do
    ip link del "$k" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  set_head_hosts ""
}

case "${1:-}" in
  up) up "${2:?nodes.sh up N [MBIT]}" "${3:-0}" ;;
  start) start "${2:?nodes.sh start NODE}" ;;
  lose) lose "${2:?nodes.sh lose NODE}" ;;
  pids) pids "${2:?nodes.sh pids NODE}" ;;
  cut) link "${2:?nodes.sh cut NODE}" down ;;
  join) link "${2:?nodes.sh join NODE}" up ;;
  down) down ;;
  *) echo "usage: nodes.sh up N [MBIT] | start NODE | lose NODE | cut NODE | join NODE | pids NODE | down" >&2
     exit 2 ;;
esac
