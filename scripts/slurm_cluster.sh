#!/usr/bin/env bash
# Install, configure and run a one-node SLURM cluster (with accounting) on this machine,
# so that the `slurm`-marked tests can submit real jobs.
#
# Usage: scripts/slurm_cluster.sh up|down [DAEMON ...]|status|daemons
#   up      install the packages if missing, write the configs, start MariaDB, munged,
#           slurmdbd, slurmctld and slurmd, and wait until the node is idle and sacct
#           answers. Returns at once if the cluster already works. Idempotent.
#   down    stop every daemon by its PID file and remove stale PID files (jobs still
#           running keep their slurmstepd and are picked up again by the next `up`);
#           with daemon names (as `daemons` prints them), only those.
#   status  print sinfo and squeue; exit 0 if the cluster works, 1 if not.
#   daemons print the names of the daemons running now, one a line (munged, mariadbd,
#           slurmdbd, slurmctld, slurmd): scripts/test stops only those it started.
#
# SLURM_CLUSTER_WAIT_S (default 60): how long `up` waits for each daemon and for the node.
# Debian 12 (SLURM 22.05), run as root, no systemd, no cgroups. One node named
# `localhost`, partition `debug`, all of nproc's CPUs, cores oversubscribable (FORCE:4)
# so that several small jobs run at once. Logs: /var/log/slurm, /var/log/mysql,
# /var/log/munge; apt output: /tmp/slurm_cluster_apt.log.
set -euo pipefail
# shellcheck source=scripts/slurm_conf_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_conf_common.sh"

readonly CLUSTER=localcluster
readonly NODE=localhost
readonly PARTITION=debug
readonly WAIT_S=${SLURM_CLUSTER_WAIT_S:-60}
readonly PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
readonly APT_LOG=/tmp/slurm_cluster_apt.log
readonly LOCK=/run/slurm_cluster.lock
readonly SLURM_CONF=/etc/slurm/slurm.conf
readonly DBD_CONF=/etc/slurm/slurmdbd.conf
readonly STATE_DIR=/var/lib/slurm
readonly LOG_DIR=/var/log/slurm
readonly DB_NAME=slurm_acct_db
# PID files and the /proc/PID/comm each must match (a reused PID is not ours).
readonly MUNGE_PID=/run/munge/munged.pid
readonly MYSQL_PID=/run/mysqld/mysqld.pid
readonly DBD_PID=/run/slurmdbd.pid
readonly CTLD_PID=/run/slurmctld.pid
readonly SLURMD_PID=/run/slurmd.pid

log() { echo "slurm_cluster: $*"; }
die() { echo "slurm_cluster: ERROR: $*" >&2; exit 1; }

# Print the last lines of the given log files (those that exist) to stderr.
show_logs() {
    local f
    for f in "$@"; do
        [[ -s $f ]] || continue
        echo "--- last lines of $f" >&2
        tail -n 10 "$f" >&2
    done
}

# alive PID: the process exists and is no zombie (PID 1 here reaps only every ~2 s).
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}

# running PIDFILE COMM: the PID file names a live process called COMM.
running() {
    local pid
    [[ -r $1 ]] || return 1
    pid=$(tr -dc '0-9' <"$1")
    [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] && alive "$pid"
}

# stop PIDFILE COMM [PIDFILE COMM ...]: TERM these daemons together, KILL those still
# alive after 20 s, and remove their PID files.
stop() {
    local pids=() names=() i pid any
    while (($#)); do
        if running "$1" "$2"; then
            pid=$(tr -dc '0-9' <"$1")
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
            names+=("$2 (pid $pid)")
        fi
        rm -f "$1"
        shift 2
    done
    ((${#pids[@]})) || return 0
    for ((i = 0; i < 200; i++)); do
        any=0
        for pid in "${pids[@]}"; do alive "$pid" && any=1; done
        ((any)) || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
    done
    log "stopped ${names[*]}"
}

# The cluster works: the node is usable and accounting answers.
cluster_works() {
    [[ -r $SLURM_CONF ]] && command -v sinfo >/dev/null && command -v sacct >/dev/null || return 1
    # Cheap check first: with slurmctld down, sinfo retries for ~9 s before it fails.
    running "$CTLD_PID" slurmctld && running "$SLURMD_PID" slurmd && running "$DBD_PID" slurmdbd || return 1
    timeout 10 sinfo -h -o %T 2>/dev/null | grep -qxE 'idle|mixed|allocated' || return 1
    timeout 10 sacct -n -X >/dev/null 2>&1
}

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    log "installing ${missing[*]} (log: $APT_LOG)"
    # DPkg::Lock::Timeout: wait for a concurrent apt instead of failing.
    if ! { apt-get -o DPkg::Lock::Timeout=300 update &&
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y \
            --no-install-recommends "${PACKAGES[@]}"; } >"$APT_LOG" 2>&1; then
        tail -n 30 "$APT_LOG" >&2
        die "apt-get failed (full log: $APT_LOG)"
    fi
}

# install_if_changed SRC DST MODE OWNER: replace DST by SRC when they differ; status 0 if
# DST changed, 1 if it was already identical.
install_if_changed() {
    if [[ -e $2 ]] && cmp -s "$1" "$2"; then
        rm -f "$1"
        chmod "$3" "$2" && chown "$4" "$2"
        return 1
    fi
    install -m "$3" -o "${4%%:*}" -g "${4##*:}" "$1" "$2" || die "cannot write $2"
    rm -f "$1"
}

# Set CPUS, MEM and DB_PASS, the values the config files are made of.
config_values() {
    CPUS=$(nproc)
    # What slurmd detects (RealMemory above it would drain the node).
    MEM=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    [[ -n $MEM ]] || MEM=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    # Keep the database password across runs; make one the first time.
    DB_PASS=$(sed -n 's/^StoragePass=//p' "$DBD_CONF" 2>/dev/null || true)
    [[ -n $DB_PASS ]] || DB_PASS=$(tr -dc 'A-Za-z0-9' </dev/urandom | head -c 24 || true)
}

render_slurm_conf() {
    cat <<EOF
# Written by scripts/slurm_cluster.sh: a one-node cluster without cgroups.
ClusterName=$CLUSTER
SlurmctldHost=$NODE
SlurmUser=slurm
$(slurm_conf_common)
JobAcctGatherType=jobacct_gather/linux
# Finished jobs leave slurmctld's memory after 60 s (sacct keeps them).
MinJobAge=60
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$NODE
NodeName=$NODE CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
# FORCE:4: up to 4 jobs share a core, so small jobs run side by side on few CPUs.
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

render_dbd_conf() {
    cat <<EOF
# Written by scripts/slurm_cluster.sh.
AuthType=auth/munge
DbdHost=$NODE
SlurmUser=slurm
PidFile=$DBD_PID
LogFile=$LOG_DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
}

# The config files on disk are those this script writes (false if either differs).
configs_current() {
    config_values
    cmp -s <(render_slurm_conf) "$SLURM_CONF" && cmp -s <(render_dbd_conf) "$DBD_CONF"
}

# Write slurm.conf and slurmdbd.conf; sets CONF_CHANGED=1 if either changed.
write_configs() {
    local tmp
    config_values
    mkdir -p /etc/slurm
    CONF_CHANGED=0
    tmp=$(mktemp)
    render_slurm_conf >"$tmp"
    if install_if_changed "$tmp" "$SLURM_CONF" 644 root:root; then CONF_CHANGED=1; fi
    tmp=$(mktemp)
    render_dbd_conf >"$tmp"
    if install_if_changed "$tmp" "$DBD_CONF" 600 slurm:slurm; then CONF_CHANGED=1; fi
}

start_munge() {
    running "$MUNGE_PID" munged && return 0
    rm -f "$MUNGE_PID"
    if [[ ! -s /etc/munge/munge.key ]]; then
        runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1 9>&- ||
        { show_logs /var/log/munge/munged.log; die "munged did not start"; }
}

start_mariadb() {
    local i
    if ! running "$MYSQL_PID" mariadbd; then
        rm -f "$MYSQL_PID"
        install -d -o mysql -g mysql -m 755 /run/mysqld
        install -d -o mysql -g adm -m 2750 /var/log/mysql
        [[ -d /var/lib/mysql/mysql ]] ||
            mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
        # mariadbd does not daemonize: detach it; it drops to the mysql user itself.
        setsid -f /usr/sbin/mariadbd --user=mysql --pid-file="$MYSQL_PID" \
            </dev/null >>/var/log/mysql/error.log 2>&1 9>&-
    fi
    for ((i = 0; i < WAIT_S * 5; i++)); do
        mariadb-admin --protocol=socket ping >/dev/null 2>&1 && break
        sleep 0.2
    done
    mariadb-admin --protocol=socket ping >/dev/null 2>&1 ||
        { show_logs /var/log/mysql/error.log; die "MariaDB did not answer within ${WAIT_S} s"; }
    # The accounting database and its user (root logs in over the unix socket).
    mariadb --protocol=socket <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO 'slurm'@'localhost';
EOF
}

# Directories the SLURM daemons need, owned by the slurm user.
slurm_dirs() {
    install -d -o slurm -g slurm -m 755 "$STATE_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$LOG_DIR"
}

start_slurmdbd() {
    local i
    if ! running "$DBD_PID" slurmdbd; then
        rm -f "$DBD_PID"
        /usr/sbin/slurmdbd </dev/null >>"$LOG_DIR/slurmdbd.log" 2>&1 9>&- ||
            { show_logs "$LOG_DIR/slurmdbd.log"; die "slurmdbd did not start"; }
    fi
    # slurmdbd answers once it has its tables (created on the first start).
    for ((i = 0; i < WAIT_S * 5; i++)); do
        timeout 10 sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1 && break
        sleep 0.2
    done
    local clusters
    clusters=$(timeout 10 sacctmgr -n -P list cluster format=cluster 2>/dev/null) ||
        { show_logs "$LOG_DIR/slurmdbd.log"; die "slurmdbd did not answer within ${WAIT_S} s"; }
    if ! grep -qx "$CLUSTER" <<<"$clusters"; then
        timeout 30 sacctmgr -i add cluster "$CLUSTER" >/dev/null ||
            die "sacctmgr could not add cluster $CLUSTER"
    fi
}

start_slurmctld_slurmd() {
    if ! running "$CTLD_PID" slurmctld; then
        rm -f "$CTLD_PID"
        /usr/sbin/slurmctld </dev/null >>"$LOG_DIR/slurmctld.log" 2>&1 9>&- ||
            { show_logs "$LOG_DIR/slurmctld.log"; die "slurmctld did not start"; }
    fi
    if ! running "$SLURMD_PID" slurmd; then
        rm -f "$SLURMD_PID"
        # -N: the node is `localhost` whatever the hostname.
        /usr/sbin/slurmd -N "$NODE" </dev/null >>"$LOG_DIR/slurmd.log" 2>&1 9>&- ||
            { show_logs "$LOG_DIR/slurmd.log"; die "slurmd did not start"; }
    fi
}

# Wait until the node is usable and sacct answers; resume the node if it is down/drained.
wait_ready() {
    local deadline=$((SECONDS + WAIT_S)) state resumed=0
    while ((SECONDS < deadline)); do
        cluster_works && return 0
        state=$(timeout 10 sinfo -h -o %T 2>/dev/null || true)
        if ((!resumed)) && [[ $state =~ down|drain ]]; then
            sleep 2 # give slurmd time to register first
            timeout 10 scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
            resumed=1
        fi
        sleep 0.3
    done
    echo "sinfo: $(timeout 10 sinfo -h -o '%T %E' 2>&1 || true)" >&2
    show_logs "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" "$LOG_DIR/slurmdbd.log"
    die "cluster not ready within ${WAIT_S} s (node not idle or sacct failing)"
}

cmd_up() {
    local t0=$EPOCHREALTIME
    if cluster_works && configs_current; then
        log "already up: $(summary)"
        return 0
    fi
    install_packages
    write_configs
    if ((CONF_CHANGED)); then # restart what runs with the old configs
        stop "$SLURMD_PID" slurmd "$CTLD_PID" slurmctld
        stop "$DBD_PID" slurmdbd
    fi
    slurm_dirs
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld_slurmd
    wait_ready
    log "up in $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}') s: $(summary)"
}

summary() {
    timeout 10 sinfo -h -o 'partition %R, node %N (%T), %c CPUs, %m MB memory' | head -n 1
}

# pick PIDFILE COMM: the pair for `stop` when COMM is among DOWN_ONLY (every daemon when that is empty).
pick() {
    if ((${#DOWN_ONLY[@]} == 0)) || [[ " ${DOWN_ONLY[*]} " == *" $2 "* ]]; then echo "$1 $2"; fi
}

cmd_down() {
    DOWN_ONLY=("$@")
    # slurmctld and slurmdbd write to accounting as they stop: the database goes last.
    # shellcheck disable=SC2046  # pick prints "PIDFILE COMM" or nothing, to be split
    stop $(pick "$SLURMD_PID" slurmd) $(pick "$CTLD_PID" slurmctld)
    # shellcheck disable=SC2046
    stop $(pick "$DBD_PID" slurmdbd)
    # shellcheck disable=SC2046
    stop $(pick "$MYSQL_PID" mariadbd) $(pick "$MUNGE_PID" munged)
    log "down${*:+ (${*})}"
}

cmd_daemons() {
    local daemons=("$MUNGE_PID" munged "$MYSQL_PID" mariadbd "$DBD_PID" slurmdbd "$CTLD_PID" slurmctld
        "$SLURMD_PID" slurmd) i
    for ((i = 0; i < ${#daemons[@]}; i += 2)); do
        if running "${daemons[i]}" "${daemons[i + 1]}"; then echo "${daemons[i + 1]}"; fi
    done
}

cmd_status() {
    if cluster_works; then
        timeout 10 sinfo
        timeout 10 squeue
        return 0
    fi
    log "not up"
    return 1
}

main() {
    cd /  # daemons inherit the working directory; do not pin the caller's
    case "${1:-}" in
    up | down)
        [[ $EUID -eq 0 ]] || die "must run as root"
        # One up/down at a time (fd 9; the daemons are started with it closed).
        exec 9>"$LOCK"
        flock -w 600 9 || die "another slurm_cluster.sh holds $LOCK"
        "cmd_$1" "${@:2}"
        ;;
    status) cmd_status ;;
    daemons) cmd_daemons ;;
    *)
        echo "usage: $0 up|down [DAEMON ...]|status|daemons" >&2
        exit 2
        ;;
    esac
}

main "$@"
