#!/usr/bin/env bash
# A single-node SLURM cluster on this host, for shardsci's tests and for trying sbatch/srun.
#
#   local_cluster.sh up      install (if missing), configure and start munged, slurmctld and
#                            slurmd, then wait until the node is usable; reuses a running cluster
#   local_cluster.sh down    stop the three daemons
#   local_cluster.sh status  show the daemons and the node; exit 0 only when the cluster is usable
#
# The node advertises 8 CPUs whatever the hardware has, so `srun -n 8` runs on 2 cores.
# Environment: SHARDSCI_SLURM_UP_TIMEOUT_S (default 60) bounds the wait for the node.
# Exit status of `up`: 0 up; 3 SLURM cannot be installed or started here (not root, no
# apt-get, the packages cannot be installed); 1 any other failure to bring the cluster up.
set -euo pipefail

readonly PROG=${0##*/}
readonly PACKAGES=(slurmctld slurmd slurm-client munge)
readonly CLUSTER_NAME=shardsci
readonly CPUS=8
readonly REAL_MEMORY_MB=16000
readonly CONF=/etc/slurm/slurm.conf
readonly STATE_DIR=/var/spool/slurmctld
readonly SLURMD_SPOOL_DIR=/var/spool/slurmd
readonly LOG_DIR=/var/log/slurm
readonly MUNGE_KEY=/etc/munge/munge.key
readonly MUNGE_RUN_DIR=/run/munge
readonly LOCK_FILE=/run/lock/shardsci-local-cluster.lock
readonly DAEMONS=(munged slurmctld slurmd)
declare -rA PID_FILE=(
    [munged]=$MUNGE_RUN_DIR/munged.pid
    [slurmctld]=/run/slurmctld.pid
    [slurmd]=/run/slurmd.pid
)
declare -rA LOG_FILE=(
    [munged]=/var/log/munge/munged.log
    [slurmctld]=$LOG_DIR/slurmctld.log
    [slurmd]=$LOG_DIR/slurmd.log
)
readonly UP_TIMEOUT_S=${SHARDSCI_SLURM_UP_TIMEOUT_S:-60}
readonly APT_TIMEOUT_S=240
readonly LOCK_TIMEOUT_S=240
readonly COMMAND_TIMEOUT_S=15
readonly STOP_TIMEOUT_S=15
readonly USABLE_STATES='^(idle|mixed|allocated|completing)$'
HOST=$(hostname -s)
readonly HOST

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 1
}

# Like die, for what makes SLURM impossible here rather than broken (exit status 3).
cannot_install() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 3
}

require_root() {
    ((EUID == 0)) || cannot_install "must run as root to $1 (running as uid $EUID)"
}

# Serialises the commands that change the cluster (the caller is root).
lock() {
    exec {lock_fd}>"$LOCK_FILE"
    flock -w "$LOCK_TIMEOUT_S" "$lock_fd" ||
        die "another $PROG held $LOCK_FILE for more than ${LOCK_TIMEOUT_S} s"
}

# --- configuration ------------------------------------------------------------------------------

render_conf() {
    cat <<EOF
# Written by scripts/slurm/local_cluster.sh: a single-node cluster for shardsci's tests.
# CPUs is advertised (SlurmdParameters=config_overrides), not measured, so srun -n $CPUS fits.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SLURMD_SPOOL_DIR
SlurmctldPidFile=${PID_FILE[slurmctld]}
SlurmdPidFile=${PID_FILE[slurmd]}
SlurmctldLogFile=${LOG_FILE[slurmctld]}
SlurmdLogFile=${LOG_FILE[slurmd]}
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$REAL_MEMORY_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

conf_is_current() {
    [[ -f $CONF ]] && cmp -s "$CONF" <(render_conf)
}

write_conf() {
    mkdir -p "${CONF%/*}"
    render_conf >"$CONF.tmp"
    chmod 644 "$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    log "wrote $CONF (node $HOST, $CPUS CPUs)"
}

# --- installation and directories ---------------------------------------------------------------

missing_packages() {
    local package
    for package in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' ||
            printf '%s\n' "$package"
    done
}

apt_get() {
    DEBIAN_FRONTEND=noninteractive timeout "$APT_TIMEOUT_S" \
        apt-get -q -y -o DPkg::Lock::Timeout=120 "$@" 2>&1
}

install_packages() {
    local missing output
    mapfile -t missing < <(missing_packages)
    ((${#missing[@]})) || return 0
    require_root "install ${missing[*]}"
    command -v apt-get >/dev/null ||
        cannot_install "apt-get not found: install ${missing[*]} with this system's package manager"
    log "installing ${missing[*]} with apt-get"
    if ! output=$(apt_get install --no-install-recommends "${missing[@]}"); then
        log "apt-get install failed; refreshing the package lists with apt-get update"
        output=$(apt_get update) ||
            cannot_install "apt-get update failed: $(tail -n 3 <<<"$output")"
        output=$(apt_get install --no-install-recommends "${missing[@]}") ||
            cannot_install "apt-get install ${missing[*]} failed: $(tail -n 3 <<<"$output")"
    fi
}

ensure_users() {
    local user
    for user in slurm munge; do
        getent passwd "$user" >/dev/null ||
            die "user '$user' does not exist after installing ${PACKAGES[*]}"
    done
}

ensure_munge_key() {
    [[ -s $MUNGE_KEY ]] && return 0
    log "creating $MUNGE_KEY"
    mkdir -p "${MUNGE_KEY%/*}"
    dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    chown munge:munge "$MUNGE_KEY"
    chmod 400 "$MUNGE_KEY"
}

ensure_dirs() {
    install -d -o munge -g munge -m 755 "$MUNGE_RUN_DIR"
    install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
    install -d -o slurm -g slurm -m 755 "$STATE_DIR" "$SLURMD_SPOOL_DIR" "$LOG_DIR"
}

# slurmctld refuses to start when the saved cluster name differs from ClusterName.
clear_stale_cluster_name() {
    local saved=$STATE_DIR/clustername
    [[ -f $saved && $(<"$saved") != "$CLUSTER_NAME" ]] || return 0
    log "removing $saved (it names cluster '$(<"$saved")', not '$CLUSTER_NAME')"
    rm -f "$saved"
}

# --- daemons ------------------------------------------------------------------------------------

# Prints the pid of daemon $1 (munged, slurmctld or slurmd) if it is running (not a zombie).
running_pid() {
    local pid_file=${PID_FILE[$1]} pid stat
    [[ -s $pid_file ]] || return 1
    pid=$(<"$pid_file")
    [[ $pid =~ ^[0-9]+$ ]] && { read -r stat <"/proc/$pid/stat"; } 2>/dev/null || return 1
    [[ $stat == "$pid ($1) "[^Z]* ]] || return 1
    printf '%s\n' "$pid"
}

is_running() { running_pid "$1" >/dev/null; }

all_daemons_running() {
    local name
    for name in "${DAEMONS[@]}"; do
        is_running "$name" || return 1
    done
}

log_tail() {
    if [[ -r $1 ]]; then
        printf 'last lines of %s:\n%s' "$1" "$(tail -n 5 "$1")"
    else
        printf 'no log at %s' "$1"
    fi
}

munge_works() {
    timeout "$COMMAND_TIMEOUT_S" munge -n 2>/dev/null |
        timeout "$COMMAND_TIMEOUT_S" unmunge >/dev/null 2>&1
}

# Starts daemon $1 with the command that follows, unless it is running. The daemon does not
# inherit the lock, which would otherwise stay held for as long as the daemon runs.
start_daemon() {
    local name=$1
    shift
    is_running "$name" && return 0
    log "starting $name"
    "$@" {lock_fd}>&- || die "$name failed to start: $(log_tail "${LOG_FILE[$name]}")"
    wait_for "$name to write ${PID_FILE[$name]}" 10 is_running "$name" ||
        die "$name exited after starting: $(log_tail "${LOG_FILE[$name]}")"
}

start_daemons() {
    start_daemon munged runuser -u munge -- /usr/sbin/munged
    wait_for "munge to issue credentials" 10 munge_works ||
        die "munged runs but 'munge -n | unmunge' fails: $(log_tail "${LOG_FILE[munged]}")"
    start_daemon slurmctld /usr/sbin/slurmctld
    start_daemon slurmd /usr/sbin/slurmd
}

process_gone() { [[ ! -e /proc/$1 ]]; }

# Stops daemon $1 with SIGTERM and waits for it to exit.
stop_daemon() {
    local pid
    pid=$(running_pid "$1") || return 0
    log "stopping $1 (pid $pid)"
    kill -TERM "$pid"
    wait_for "$1 (pid $pid) to exit" "$STOP_TIMEOUT_S" process_gone "$pid" ||
        die "$1 (pid $pid) did not exit within ${STOP_TIMEOUT_S} s of SIGTERM"
    rm -f "${PID_FILE[$1]}"
}

stop_daemons() {
    stop_daemon slurmd
    stop_daemon slurmctld
    stop_daemon munged
}

# --- the node -----------------------------------------------------------------------------------

node_state() {
    timeout "$COMMAND_TIMEOUT_S" sinfo --noheader --Node --nodes="$HOST" --format=%T 2>/dev/null
}

node_usable() { [[ $(node_state) =~ $USABLE_STATES ]]; }

# A node marked down or drained (say, by a crash) does not come back by itself.
resume_if_down() {
    [[ $(node_state) =~ ^(down|drain) ]] || return 0
    log "node $HOST is $(node_state); resuming it"
    timeout "$COMMAND_TIMEOUT_S" scontrol update NodeName="$HOST" State=RESUME
}

node_ready() {
    resume_if_down
    node_usable
}

# Runs the command after $2 every 0.5 s until it succeeds or $2 seconds pass ($1 describes it).
wait_for() {
    local what=$1 deadline=$((SECONDS + $2))
    shift 2
    until "$@"; do
        ((SECONDS < deadline)) || {
            log "gave up waiting for $what"
            return 1
        }
        sleep 0.5
    done
}

cluster_is_up() { all_daemons_running && conf_is_current && node_usable; }

# slurmctld recovers from its saved state the jobs that were running when it last stopped. If
# the machine restarted since (or was restored from a snapshot), their processes are gone, yet
# slurmctld holds their CPUs until their time limits and new jobs pend for "Resources". Cancels
# each job saved as running since before `up` started slurmctld ($1, epoch seconds) that has no
# slurmstepd on this host.
cancel_jobs_without_processes() {
    local before=$1 job start
    while read -r job start; do
        (($(date -d "$start" +%s) < before)) || continue
        pgrep -f "^slurmstepd: \[$job\." >/dev/null && continue
        log "cancelling job $job: saved as running since $start, but none of its processes runs"
        timeout "$COMMAND_TIMEOUT_S" scancel "$job" || die "scancel $job failed"
    done < <(timeout "$COMMAND_TIMEOUT_S" squeue --noheader --states=RUNNING,COMPLETING,SUSPENDED \
        --format='%i %S')
}

# --- commands -----------------------------------------------------------------------------------

reuse_if_up() {
    cluster_is_up || return 1
    log "cluster '$CLUSTER_NAME' is already up on $HOST: reusing it"
}

# Reusing needs no root; the second check catches a cluster another `up` started while we
# waited for the lock.
cmd_up() {
    reuse_if_up && return 0
    require_root "start the cluster"
    lock
    reuse_if_up && return 0
    install_packages
    ensure_users
    if ! conf_is_current; then
        stop_daemons
        write_conf
    fi
    ensure_munge_key
    ensure_dirs
    clear_stale_cluster_name
    local started_at
    started_at=$(date +%s)
    is_running slurmctld && started_at=0
    start_daemons
    wait_for "node $HOST to become idle" "$UP_TIMEOUT_S" node_ready ||
        die "node $HOST is '$(node_state)', not idle, ${UP_TIMEOUT_S} s after starting:" \
            "$(log_tail "${LOG_FILE[slurmctld]}")"
    cancel_jobs_without_processes "$started_at"
    log "cluster '$CLUSTER_NAME' is up on $HOST: node $(node_state), $CPUS CPUs"
}

cmd_down() {
    require_root "stop the cluster"
    lock
    stop_daemons
    log "cluster '$CLUSTER_NAME' is down"
}

cmd_status() {
    local name pid
    for name in "${DAEMONS[@]}"; do
        if pid=$(running_pid "$name"); then
            printf '%-10s running (pid %s)\n' "$name" "$pid"
        else
            printf '%-10s stopped\n' "$name"
        fi
    done
    if is_running slurmctld; then
        timeout "$COMMAND_TIMEOUT_S" sinfo || true
    fi
    cluster_is_up
}

main() {
    case ${1:-} in
        up) cmd_up ;;
        down) cmd_down ;;
        status) cmd_status ;;
        *)
            printf 'usage: %s {up|down|status}\n' "$PROG" >&2
            exit 2
            ;;
    esac
}

main "$@"
