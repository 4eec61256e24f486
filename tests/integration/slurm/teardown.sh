#!/bin/bash
# Stop the single-node test Slurm started by setup.sh and remove its state.
# Idempotent: safe to run when nothing is running / the dir does not exist.
# Kills only processes identified by this instance's pid files / spool sockets.
set -uo pipefail

SP_DIR=${SP_DIR:-/tmp/slurm-proto/cluster}
log() { echo "[slurm-teardown $(date +%T.%N | cut -c1-12)] $*" >&2; }

# pid from pid file, only if that process still is the expected program
pid_of() {  # $1 pidfile  $2 expected comm
    local p
    [ -s "$1" ] || return 1
    p=$(cat "$1" 2>/dev/null) || return 1
    # (a killed daemon can stay a zombie for a while: PID 1 here reaps slowly)
    [ -n "$p" ] && [ "$(ps -o comm= -p "$p" 2>/dev/null)" = "$2" ] \
        && [ "$(ps -o stat= -p "$p" 2>/dev/null | cut -c1)" != Z ] && echo "$p"
}

# all descendants of a pid (depth first), by walking ppid links
descendants() {
    local c
    for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        descendants "$c"; echo "$c"
    done
}

stop_pids() {  # $1 grace (1/10 s); SIGTERM, wait up to grace, then SIGKILL
    local grace=$1; shift
    local pids=("$@") i alive
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null
    for i in $(seq 1 "$grace"); do
        alive=()
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
        ((${#alive[@]})) || return 0
        sleep 0.1
    done
    log "SIGKILL ${alive[*]}"
    kill -KILL "${alive[@]}" 2>/dev/null
    return 0
}

if [ -d "$SP_DIR" ]; then
    export SLURM_CONF="$SP_DIR/slurm.conf"
    ctld=$(pid_of "$SP_DIR/run/slurmctld.pid" slurmctld)
    slurmd_pid=$(pid_of "$SP_DIR/run/slurmd.pid" slurmd)
    munged_pid=$(pid_of "$SP_DIR/run/munged.pid" munged)

    step_pids() {  # slurmstepd processes owning unix sockets in our spool dir
        ss -xlpn 2>/dev/null | grep -F "$SP_DIR/spool/" \
            | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u
    }

    # job id range used by this instance (for the /dev/shm cleanup below)
    first_job=$(cat "$SP_DIR/first_job_id" 2>/dev/null)
    next_job=""
    if [ -n "$ctld" ] && [ -f "$SLURM_CONF" ]; then
        next_job=$(timeout 5 scontrol show config 2>/dev/null | awk '$1 == "NEXT_JOB_ID" {print $3}')
    fi

    # 1. cancel every job while the controller is still up (tasks get
    #    SIGTERM now, SIGKILL after KillWait); give steps up to 3 s to go.
    if [ -n "$ctld" ] && [ -f "$SLURM_CONF" ]; then
        jobs=$(timeout 5 squeue -h -o %i 2>/dev/null)
        if [ -n "$jobs" ]; then
            log "cancelling jobs: $(echo $jobs)"
            timeout 5 scancel $jobs 2>/dev/null
            for i in $(seq 1 30); do
                [ -z "$(step_pids)" ] && break
                sleep 0.1
            done
        fi
    fi

    # 2. remaining slurmstepd processes of this instance (e.g. a step whose
    #    whole srun process group was SIGKILLed, which then lingers for
    #    KillWait + a few s of retries) and their tasks: SIGKILL.
    #    slurmd does not kill running steps when it stops.
    for s in $(step_pids); do
        if [ "$(ps -o comm= -p "$s")" = slurmstepd ]; then
            kids=$(descendants "$s")
            log "killing slurmstepd $s and its tasks: $(echo $kids)"
            kill -KILL $kids "$s" 2>/dev/null
        fi
    done

    log "stopping daemons"
    # 3. daemons. On SIGTERM slurmd and slurmctld each take ~2 s to exit
    #    (slurmd up to ~10 s while a job is still COMPLETING: it retries
    #    "epilog complete" to the controller). All state is deleted anyway,
    #    so by default they are SIGKILLed; SP_GRACEFUL=1 uses SIGTERM first.
    if [ "${SP_GRACEFUL:-0}" = 1 ]; then
        stop_pids 30 $slurmd_pid
        stop_pids 50 $ctld
    else
        [ -n "$slurmd_pid$ctld" ] && kill -KILL $slurmd_pid $ctld 2>/dev/null
    fi
    stop_pids 50 $munged_pid
    log "daemons stopped"

    # 4. MPICH shm segments left in /dev/shm by killed ranks of srun steps:
    #    /dev/shm/mpich_{shm,vci}_<FNV-1a("<job>.<step>") hex>_<node>
    #    (controller already dead: assume at most 1000 jobs were submitted)
    [ -n "$first_job" ] && [ -z "$next_job" ] && next_job=$((first_job + 1000))
    py=$(command -v /usr/bin/python3 || command -v python3)
    if [ -n "$first_job" ] && [ -n "$next_job" ] && [ -n "$py" ]; then
        "$py" - "$first_job" "$next_job" <<'PY'
import os, sys
first, nxt = int(sys.argv[1]), int(sys.argv[2])
def fnv1a(s):
    h = 2166136261
    for b in s.encode():
        h = ((h ^ b) * 16777619) & 0xffffffff
    return h
want = {"%x" % fnv1a("%d.%d" % (j, s)) for j in range(first, nxt) for s in range(128)}
for f in os.listdir("/dev/shm"):
    parts = f.split("_")
    if len(parts) == 4 and parts[0] == "mpich" and parts[1] in ("shm", "vci") and parts[2] in want:
        try:
            os.unlink("/dev/shm/" + f)
            print("[slurm-teardown] removed stale /dev/shm/" + f, file=sys.stderr)
        except OSError:
            pass
PY
    fi
    rm -rf "$SP_DIR"
fi

# Report (do not kill) remaining slurm/munge processes of this instance:
# daemons/stepds whose command line names $SP_DIR, or clients (srun, salloc,
# sbatch) started with SLURM_CONF=$SP_DIR/slurm.conf. Clients of a dead
# controller hang; salloc ignores SIGTERM -- their owner must SIGKILL them.
left=""
for p in $(ps -eo pid=,stat=,comm= | awk '$2 !~ /Z/ && $3 ~ /^(slurmctld|slurmd|slurmstepd|munged|srun|salloc|sbatch)$/ {print $1}'); do
    if tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -qF "$SP_DIR/" \
       || tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qxF "SLURM_CONF=$SP_DIR/slurm.conf"; then
        left+="$(ps -o pid=,stat=,args= -p "$p")"$'\n'
    fi
done
[ -n "$left" ] && log "still running:" && printf '%s' "$left" >&2
exit 0
