#!/bin/bash
# Single-node Slurm (Debian 12, slurm-wlm 22.05.8) for tests. Idempotent:
# installs packages if missing, tears down any previous instance in $SP_DIR,
# writes config, starts (munged +) slurmctld + slurmd, waits for node idle.
#
# Knobs (env):
#   SP_DIR          state/config dir            (default /tmp/slurm-proto/cluster)
#   SP_CTLD_PORT    SlurmctldPort               (default 16817)
#   SP_SLURMD_PORT  SlurmdPort                  (default 16818)
#   SP_CPUS         CPUs advertised for node    (default: nproc; may exceed nproc)
#   SP_AUTH         munge | none                (default munge)
#   SP_TIMEOUT      seconds to wait for idle    (default 30)
#   SP_FIRST_JOB_ID FirstJobId                  (default: random 1000..60M)
# Afterwards:  source "$SP_DIR/env.sh"   (exports SLURM_CONF)
set -euo pipefail

SP_DIR=${SP_DIR:-/tmp/slurm-proto/cluster}
SP_CTLD_PORT=${SP_CTLD_PORT:-16817}
SP_SLURMD_PORT=${SP_SLURMD_PORT:-16818}
SP_CPUS=${SP_CPUS:-$(nproc)}
SP_AUTH=${SP_AUTH:-munge}
SP_TIMEOUT=${SP_TIMEOUT:-30}
# Random first job id: MPICH names its node shm segment
# /dev/shm/mpich_shm_<FNV1a(PMI kvsname)>_<node>, and under srun --mpi=pmi2
# the kvsname is "<jobid>.<stepid>". A fresh cluster restarting at job 1
# would reuse the names of segments left behind by SIGKILLed ranks of an
# earlier instance -> MPI_Init fails ("Out of memory") or spins forever.
SP_FIRST_JOB_ID=${SP_FIRST_JOB_ID:-$(( ((RANDOM << 15) | RANDOM) % 60000000 + 1000 ))}
HERE=$(cd "$(dirname "$0")" && pwd)

log() { echo "[slurm-setup] $*" >&2; }

# ---- 1. install (only if missing) -------------------------------------------
need=()
for b in slurmctld slurmd srun sinfo munged; do command -v "$b" >/dev/null || need+=("$b"); done
if ((${#need[@]})); then
    log "installing slurm (missing: ${need[*]})"
    # Make sure the package scripts do not start system daemons (Docker
    # images usually already have a policy-rc.d that exits 101).
    made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        made_policy=1
    fi
    t0=$(date +%s)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmctld slurmd slurm-client munge >"$HERE/apt-install.log" 2>&1 \
        || { [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d; cat "$HERE/apt-install.log" >&2; exit 1; }
    [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
    log "apt-get install took $(( $(date +%s) - t0 ))s"
fi

# ---- 2. clean slate -----------------------------------------------------------
SP_DIR="$SP_DIR" "$HERE/teardown.sh"

H=$(hostname -s)
mkdir -p "$SP_DIR"/{state,spool,log,run,munge}
chmod 755 "$SP_DIR" "$SP_DIR/munge"

# ---- 3. auth ------------------------------------------------------------------
if [ "$SP_AUTH" = munge ]; then
    mkdir -p "$SP_DIR/munge/key"
    chmod 700 "$SP_DIR/munge/key"
    dd if=/dev/urandom of="$SP_DIR/munge/key/munge.key" bs=128 count=1 status=none
    chmod 400 "$SP_DIR/munge/key/munge.key"
    # -f/--force: allow running as root and with a socket in /tmp.
    munged -f \
        --socket="$SP_DIR/munge/munge.socket" \
        --key-file="$SP_DIR/munge/key/munge.key" \
        --pid-file="$SP_DIR/run/munged.pid" \
        --log-file="$SP_DIR/log/munged.log" \
        --seed-file="$SP_DIR/munge/munged.seed"
    AUTH_LINES="AuthType=auth/munge
AuthInfo=socket=$SP_DIR/munge/munge.socket
CredType=cred/munge"
else
    # auth/none + cred/none: present (undocumented) in 22.05; no munged needed.
    AUTH_LINES="AuthType=auth/none
CredType=cred/none"
fi

# ---- 4. config ----------------------------------------------------------------
OVERRIDE=""
if [ "$SP_CPUS" -gt "$(nproc)" ]; then
    # advertise more CPUs than exist; without this slurmd registers the real
    # count and the node is marked INVALID/drained.
    OVERRIDE="SlurmdParameters=config_overrides"
fi

cat > "$SP_DIR/slurm.conf" <<EOF
ClusterName=sptest
SlurmctldHost=$H(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$SP_CTLD_PORT
SlurmdPort=$SP_SLURMD_PORT
$AUTH_LINES
StateSaveLocation=$SP_DIR/state
SlurmdSpoolDir=$SP_DIR/spool
SlurmctldPidFile=$SP_DIR/run/slurmctld.pid
SlurmdPidFile=$SP_DIR/run/slurmd.pid
SlurmctldLogFile=$SP_DIR/log/slurmctld.log
SlurmdLogFile=$SP_DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=pmi2
FirstJobId=$SP_FIRST_JOB_ID
ReturnToService=2
EnforcePartLimits=ALL
SchedulerParameters=batch_sched_delay=0
KillWait=5
InactiveLimit=0
$OVERRIDE
NodeName=$H NodeAddr=127.0.0.1 CPUs=$SP_CPUS State=UNKNOWN
PartitionName=debug Nodes=$H Default=YES MaxTime=INFINITE State=UP
EOF

echo "$SP_FIRST_JOB_ID" > "$SP_DIR/first_job_id"
cat > "$SP_DIR/env.sh" <<EOF
export SLURM_CONF=$SP_DIR/slurm.conf
EOF
export SLURM_CONF="$SP_DIR/slurm.conf"

# ---- 5. daemons (daemonised: they setsid + write their pid files) -------------
t0=$(date +%s%N)
slurmctld -f "$SLURM_CONF"
deadline=$(( $(date +%s) + SP_TIMEOUT ))
# Wait for the controller port before starting slurmd (and before any
# client call): slurmd's registration / a client's connect is retried only
# after ~1 s when the controller is not listening yet.
until ss -Hltn "sport = :$SP_CTLD_PORT" | grep -q . || [ "$(date +%s)" -ge "$deadline" ]; do
    sleep 0.02
done
slurmd -f "$SLURM_CONF" -N "$H"

until [ "$(sinfo -h -n "$H" -o %T 2>/dev/null)" = idle ]; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
        log "node did not become idle within ${SP_TIMEOUT}s"
        sinfo -N -l >&2 || true
        tail -n 20 "$SP_DIR/log/slurmctld.log" "$SP_DIR/log/slurmd.log" >&2 || true
        exit 1
    fi
    sleep 0.1
done
log "node $H idle $(( ($(date +%s%N) - t0) / 1000000 )) ms after daemon start (auth=$SP_AUTH cpus=$SP_CPUS)"
log "use: source $SP_DIR/env.sh"
