#!/usr/bin/env bash
# A test bed of hosts on one machine: N network namespaces, each a "host" with its own address,
# joined by veth pairs to one bridge, so that a multi-node job can be tried without a cluster.
#
#   scripts/netns_hosts.sh up N      # hosts ${PREFIX}1..N at ${SUBNET}.1..N/24 (needs root and `ip`)
#   scripts/netns_hosts.sh status    # the hosts and their addresses
#   scripts/netns_hosts.sh down      # remove them (and the bridge)
#
# Run a node inside host K:  ip netns exec ${PREFIX}K python -m launcher ...  (docs/multinode.md)
# The namespaces share this machine's filesystem and process table: a run_dir under /tmp is a
# shared filesystem for them. Only the network is separate (each has lo and eth0, no route out).
#
# Environment: NETNS_PREFIX (default tnode), NETNS_SUBNET (first three octets, default 10.77.0),
# NETNS_BRIDGE (default tbr77).
set -euo pipefail

PREFIX=${NETNS_PREFIX:-tnode}
SUBNET=${NETNS_SUBNET:-10.77.0}
BRIDGE=${NETNS_BRIDGE:-tbr77}

hosts() { ip netns list | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" || true; }

down() {
    for ns in $(hosts); do
        ip link del "v${ns}" 2>/dev/null || true  # removes the peer inside the namespace too
        ip netns del "$ns"
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

up() {
    local n=$1
    [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 250 ]] || { echo "up N: N must be 1..250, got '$n'" >&2; exit 2; }
    down
    ip link add "$BRIDGE" type bridge
    ip link set "$BRIDGE" up
    for k in $(seq 1 "$n"); do
        local ns="${PREFIX}${k}"
        ip netns add "$ns"
        ip link add "v${ns}" type veth peer name eth0 netns "$ns"
        ip link set "v${ns}" master "$BRIDGE" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "${SUBNET}.${k}/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
    status
}

status() {
    local found=0
    for ns in $(hosts); do
        found=1
        printf '%s\t%s\n' "$ns" "$(ip -n "$ns" -o -4 addr show dev eth0 | awk '{print $4}')"
    done
    [[ $found == 1 ]] || echo "no hosts (scripts/netns_hosts.sh up N)"
}

case "${1:-}" in
    up) up "${2:?up N: how many hosts}" ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up N | down | status" >&2; exit 2 ;;
esac
