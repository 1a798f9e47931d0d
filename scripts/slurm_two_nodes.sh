#!/usr/bin/env bash
# A SLURM cluster of two nodes on one machine: each node a network namespace of the test bed
# (scripts/netns_hosts.sh), one slurmctld on host 1, one slurmd per host (NodeName nK, NodeAddr
# its own address). Needs root and SLURM's packages (scripts/slurm_cluster.sh up installs them).
#
#   scripts/slurm_two_nodes.sh up      # hosts, configs, munged (if none runs), slurmctld, 2 slurmd; waits for idle
#   scripts/slurm_two_nodes.sh status  # sinfo of the two-node cluster
#   scripts/slurm_two_nodes.sh down    # stop its daemons, remove the hosts
#   scripts/slurm_two_nodes.sh run CMD...  # run CMD on host 1 with SLURM_CONF set (sbatch, train ...)
#
# It stays apart from the one-node cluster of scripts/slurm_cluster.sh: its own slurm.conf, state,
# logs and PID files under SLURM_TWO_DIR (default /tmp/slurm_two_nodes), its ports inside the
# namespaces, no accounting (job states come from scontrol). Clients need SLURM_CONF=$DIR/slurm.conf
# and host 1's network, which `run` gives. Inside each host the machine's hostname and n1/n2 resolve
# to the hosts' addresses (/etc/netns/NAME/hosts), so ranks find each other by name.
#
# Environment: NETNS_PREFIX, NETNS_SUBNET, NETNS_BRIDGE as for netns_hosts.sh; SLURM_TWO_DIR;
# SLURM_CLUSTER_WAIT_S (default 60).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/slurm_conf_common.sh
source "$HERE/slurm_conf_common.sh"
PREFIX=${NETNS_PREFIX:-tnode}
SUBNET=${NETNS_SUBNET:-10.77.0}
DIR=${SLURM_TWO_DIR:-/tmp/slurm_two_nodes}
WAIT_S=${SLURM_CLUSTER_WAIT_S:-60}
HOST=$(hostname -s)
export SLURM_CONF=$DIR/slurm.conf

log() { echo "slurm_two_nodes: $*"; }
die() { echo "slurm_two_nodes: ERROR: $*" >&2; exit 1; }

# on K CMD...: run CMD in host K's network, with host K's /etc/hosts, and /sys as it is (cgroups).
on() {
    local k=$1
    shift
    unshare -m sh -c 'mount --bind "$0" /etc/hosts && net=$1 && shift && exec nsenter --net="$net" -- "$@"' \
        "/etc/netns/${PREFIX}${k}/hosts" "/run/netns/${PREFIX}${k}" "$@"
}

write_conf() {
    local cpus
    cpus=$(nproc)
    mkdir -p "$DIR/state" "$DIR/spool/n1" "$DIR/spool/n2"
    cat >"$SLURM_CONF" <<EOF
# Written by scripts/slurm_two_nodes.sh: two nodes in network namespaces, no accounting, no cgroups.
ClusterName=twonodes
SlurmctldHost=$HOST(${SUBNET}.1)
SlurmUser=root
$(slurm_conf_common)
JobAcctGatherType=jobacct_gather/none
MinJobAge=300
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.%n.log
AccountingStorageType=accounting_storage/none
NodeName=n1 NodeAddr=${SUBNET}.1 CPUs=$cpus RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeAddr=${SUBNET}.2 CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    for k in 1 2; do
        mkdir -p "/etc/netns/${PREFIX}${k}"
        printf '127.0.0.1 localhost\n%s.1 n1\n%s.2 n2\n%s.%s %s\n' "$SUBNET" "$SUBNET" "$SUBNET" "$k" "$HOST" \
            >"/etc/netns/${PREFIX}${k}/hosts"
    done
}

# stop_pid FILE: TERM the process a PID file names, KILL it after 10 s; remove the file.
stop_pid() {
    local pid i
    [[ -r $1 ]] || return 0
    pid=$(tr -dc '0-9' <"$1")
    rm -f "$1"
    [[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
}

cmd_down() {
    stop_pid "$DIR/slurmd.n1.pid"
    stop_pid "$DIR/slurmd.n2.pid"
    stop_pid "$DIR/slurmctld.pid"
    stop_pid "$DIR/munged.pid"  # only a munged that `up` started (one that was running stays)
    rm -rf "/etc/netns/${PREFIX}1" "/etc/netns/${PREFIX}2"
    bash "$HERE/netns_hosts.sh" down >/dev/null
    log "down"
}

cmd_up() {
    [[ $EUID -eq 0 ]] || die "must run as root"
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null ||
        die "SLURM is not installed (scripts/slurm_cluster.sh up installs it)"
    cmd_down >/dev/null
    bash "$HERE/netns_hosts.sh" up 2 >/dev/null
    write_conf
    if ! pgrep -x munged >/dev/null; then  # the one-node cluster's munged serves both, if it runs
        mkdir -p /run/munge && chown munge:munge /run/munge
        runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1 || die "munged did not start"
        cp /run/munge/munged.pid "$DIR/munged.pid"  # ours: `down` stops it again
    fi
    on 1 slurmctld -i </dev/null >/dev/null 2>&1 || die "slurmctld did not start ($DIR/slurmctld.log)"
    on 1 slurmd -N n1 </dev/null >/dev/null 2>&1 || die "slurmd n1 did not start ($DIR/slurmd.n1.log)"
    on 2 slurmd -N n2 </dev/null >/dev/null 2>&1 || die "slurmd n2 did not start ($DIR/slurmd.n2.log)"
    local i
    for ((i = 0; i < WAIT_S * 2; i++)); do
        if [[ $(on 1 sinfo -h -N -o %T 2>/dev/null | grep -cxE 'idle|mixed|allocated') == 2 ]]; then
            cmd_status
            return 0
        fi
        sleep 0.5
    done
    tail -n 5 "$DIR"/*.log >&2 || true
    die "the two nodes did not become idle within $WAIT_S s"
}

cmd_status() { on 1 sinfo -N; }

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    run) shift; on 1 "$@" ;;
    *) echo "usage: $0 up | down | status | run CMD..." >&2; exit 2 ;;
esac
