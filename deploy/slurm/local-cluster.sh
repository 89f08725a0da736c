#!/usr/bin/env bash
# A Slurm cluster on this one machine, to run deploy/slurm/elastic-rl.sbatch for real: Debian's slurm-wlm
# and munge, one slurmctld, and one slurmd per node name (erl-1..erl-N, all on this host, each on its
# own port: Debian's slurmd is built to run several per host with `slurmd -N NAME`).
#
#   deploy/slurm/local-cluster.sh start [N]        install if missing, write the config, start N nodes (3)
#   deploy/slurm/local-cluster.sh run SPEC [ARGS]  sbatch the spec on all nodes, wait, print its output
#   deploy/slurm/local-cluster.sh stop             stop slurmctld, the slurmds, and munged if we started it
#
# `make slurm` is start, run examples/tiny-grpo.yaml, stop. Everything binds 127.0.0.1. Needs root.
# The config goes to /etc/slurm (where sinfo, squeue and scancel look), only if no other config is there;
# state in /var/spool/erl-slurm, logs in /var/log/erl-slurm, pid files in /run/erl-slurm.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
CONF_DIR=/etc/slurm
STATE=/var/spool/erl-slurm
LOGS=/var/log/erl-slurm
RUN=/run/erl-slurm
# The first line of every file this script writes: it rewrites only those.
MARK="# written by elastic-rl deploy/slurm/local-cluster.sh"

die() { echo "local-cluster: $*" >&2; exit 1; }
log() { echo "local-cluster: $*"; }

install_packages() {
    local missing=()
    for package in slurm-wlm munge; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        return
    fi
    command -v apt-get >/dev/null || die "needs Debian's ${missing[*]} (apt-get not found)"
    log "installing ${missing[*]} (apt-get)"
    apt-get update -qq
    # The packages try to start their services: without systemd (a container) that fails harmlessly.
    # (Not tried on a host run by systemd, where they start as services too.)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

start_munge() {
    if [ ! -s /etc/munge/munge.key ]; then
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    if munge -n >/dev/null 2>&1; then
        return  # a munged already runs (the system's service): use it
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$RUN/munged.ours"
    for _ in $(seq 50); do
        munge -n >/dev/null 2>&1 && return
        sleep 0.1
    done
    die "munged did not start; see /var/log/munge/munged.log"
}

# Refuse to overwrite a config someone else wrote.
check_ours() {
    if [ -e "$1" ] && [ "$(head -n 1 "$1")" != "$MARK" ]; then
        die "$1 exists and was not written by this script: move it away first"
    fi
}

write_config() {
    local nodes=$1 host hardware proctrack
    host=$(hostname -s)
    # What slurmd finds on this machine (CPUs, sockets, cores, memory): each node name claims all of it.
    # Memory is not a consumable resource here (CR_Core), so the names share it without counting.
    hardware=$(slurmd -C | head -n 1 | sed 's/^NodeName=[^ ]* //')
    check_ours "$CONF_DIR/slurm.conf"
    check_ours "$CONF_DIR/cgroup.conf"
    # proctrack/cgroup, as on a real cluster: a step's processes are the ones in its cgroup, so a
    # process that leaves its parent (erld's children when erld dies) stays in the step and ends
    # with it. Where cgroup v1's freezer is not mounted, proctrack/linuxproc follows parent pids
    # instead, and such an orphan outlives its step.
    if [ -d /sys/fs/cgroup/freezer ]; then
        proctrack=proctrack/cgroup
        cat >"$CONF_DIR/cgroup.conf" <<EOF
$MARK
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
EOF
    else
        proctrack=proctrack/linuxproc
        rm -f "$CONF_DIR/cgroup.conf"
    fi
    {
        echo "$MARK"
        cat <<EOF
ClusterName=erl-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
# Bind 127.0.0.1 (SlurmctldHost's address, each node's NodeAddr), not every interface.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
ProctrackType=$proctrack
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmctldPort=6817
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
EOF
        for i in $(seq "$nodes"); do
            echo "NodeName=erl-$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((6830 + i)) $hardware State=UNKNOWN"
        done
        echo "PartitionName=erl Nodes=erl-[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF_DIR/slurm.conf"
}

# The pid in pid file $1, if that process runs and is named $2 (not a zombie, nor a later process
# that got the same pid).
alive_pid() {
    local pid stat_name
    pid=$(cat "$1" 2>/dev/null) || return 1
    stat_name=$(ps -o stat=,comm= -p "$pid" 2>/dev/null) || return 1
    [[ $stat_name != Z* && $stat_name == *" $2" ]] && echo "$pid"
}

start() {
    local nodes=${1:-3}
    [ "$(id -u)" -eq 0 ] || die "run it as root (it installs packages and starts daemons)"
    install_packages
    mkdir -p "$CONF_DIR"
    install -d -o slurm -g slurm "$STATE" "$STATE/ctld" "$LOGS" "$RUN"
    stop_slurm  # a fresh start: the node names may have changed
    start_munge
    write_config "$nodes"
    slurmctld
    for _ in $(seq 100); do
        scontrol ping 2>/dev/null | grep -q UP && break
        sleep 0.2
    done
    for i in $(seq "$nodes"); do
        slurmd -N "erl-$i"
    done
    for _ in $(seq 150); do
        [ "$(sinfo -h -t idle -o %D 2>/dev/null)" = "$nodes" ] && break
        sleep 0.2
    done
    sinfo
    [ "$(sinfo -h -t idle -o %D)" = "$nodes" ] || die "not all $nodes nodes came up; see $LOGS"
    log "slurm $(sinfo -V | awk '{print $2}') with $nodes nodes on $(hostname -s); stop it with: $0 stop"
}

# The pids of the slurm daemons that run, by their pid files (slurmctld.pid, slurmd-erl-1.pid, ...).
running_slurm_daemons() {
    local f name
    for f in "$RUN"/slurm*.pid; do
        name=$(basename "$f" .pid)
        alive_pid "$f" "${name%%-*}" || true
    done
}

stop_slurm() {
    local pid
    if alive_pid "$RUN/slurmctld.pid" slurmctld >/dev/null; then
        scontrol shutdown >/dev/null 2>&1 || true  # slurmctld and every slurmd
    fi
    for _ in $(seq 100); do
        [ -n "$(running_slurm_daemons)" ] || break
        sleep 0.2
    done
    for pid in $(running_slurm_daemons); do
        kill "$pid"
    done
}

stop() {
    stop_slurm
    if [ -e "$RUN/munged.ours" ]; then
        local pid
        if pid=$(alive_pid /run/munge/munged.pid munged); then
            kill "$pid"
        fi
        rm -f "$RUN/munged.ours"
    fi
    log "stopped"
}

# sbatch the job on every node, wait for it, print its output; the exit code is the batch script's.
run() {
    local spec=${1:?usage: $0 run SPEC [erl run options]} nodes tmp started id state exit_code
    shift
    nodes=$(sinfo -h -o %D)
    tmp=$(mktemp -d /tmp/erl-slurm-run.XXXXXX)
    started=$(date +%s)
    # CPU slots: 2 per node, so the tiny job's 3 (2 engines, 1 trainer) spread over the nodes.
    # No pre-imported interpreters: 3 erlds' pools importing torch at once would take the 2 cores here.
    id=$(ERL_HOME=$REPO ERL_LOG_DIR=$tmp/logs ERL_CPU_DEVICES=2 \
        ERL_DAEMON_ARGS="--pool trainer=0 --pool orchestrator=0 --pool engine=0" \
        sbatch --parsable --nodes="$nodes" --time=30 --chdir="$REPO" --output="$tmp/slurm-%j.out" \
        "$REPO/deploy/slurm/elastic-rl.sbatch" "$spec" --workdir "$tmp/work" "$@")
    log "Slurm job $id on $nodes nodes; work dir, logs and output under $tmp"
    # Polled here rather than with sbatch --wait, which looks less and less often (up to every 32 s).
    while :; do
        state=$(scontrol show job "$id" -o | sed -n 's/.*JobState=\([^ ]*\).*/\1/p')
        case $state in
            PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED) sleep 1 ;;
            *) break ;;
        esac
    done
    exit_code=$(scontrol show job "$id" -o | sed -n 's/.* ExitCode=\([0-9]*\):.*/\1/p')
    cat "$tmp/slurm-$id.out"
    log "Slurm job $id $state, exit code $exit_code, after $(($(date +%s) - started)) s; logs in $tmp/logs"
    [ "$state" = COMPLETED ] && [ "$exit_code" = 0 ]
}

case "${1:-}" in
    start) start "${2:-3}" ;;
    stop) stop ;;
    run) shift; run "$@" ;;
    *) die "usage: $0 start [N] | run SPEC [erl run options] | stop" ;;
esac
