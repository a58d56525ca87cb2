#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine: munge, slurmctld and slurmd from Debian's packages
# (slurmctld slurmd slurm-client munge), run as root without systemd. Idempotent: a cluster already
# up with the same configuration is left alone; a changed configuration restarts the daemons.
#
# Used by tests/test_slurm.py and tests/test_fault_tolerance.py; also handy to try the Slurm profile
# by hand:  sudo scripts/slurm/start.sh && snakemake --profile workflow/profiles/slurm \
#             --slurm-no-account --slurm-status-command squeue --config scale=smoke reports/paper.html
#
# Environment: SLURM_FAKE_GPUS (default 8): GPUs the node advertises (GRES without devices: jobs
# that ask for GPUs get scheduled, nothing more). SLURM_CPUS (default: 4 per core, at least 8): CPUs
# the node advertises; more than the machine has, so that short jobs (mostly Python start-up) run
# side by side instead of queueing behind each other. SLURM_KILL_WAIT (default 30): seconds between
# SIGTERM and SIGKILL when a job is cancelled, requeued or preempted (Slurm's KillWait).
# Exit codes: 0 up; 77 not root; 78 packages missing; 79 /etc/slurm/slurm.conf exists and is not
# ours (a real cluster's node: left alone unless SLURM_TEST_CLUSTER_FORCE=1); 1 the cluster did not
# come up (logs named).
set -euo pipefail

log() { echo "slurm/start.sh: $*" >&2; }
[ "$(id -u)" = 0 ] || { log "must run as root"; exit 77; }
missing=()
for b in munged mungekey slurmctld slurmd sbatch squeue scontrol sinfo; do
  command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "missing ${missing[*]}: apt-get install slurmctld slurmd slurm-client munge"
  exit 78
fi
export PATH="/usr/sbin:/sbin:$PATH"
MARK="# Written by scripts/slurm/start.sh"
if [ -s /etc/slurm/slurm.conf ] && ! head -1 /etc/slurm/slurm.conf | grep -qF "$MARK" && [ "${SLURM_TEST_CLUSTER_FORCE:-0}" != 1 ]; then
  log "/etc/slurm/slurm.conf exists and was not written by this script: not touching this machine's Slurm"
  exit 79
fi

HOST=$(hostname -s)
GPUS=${SLURM_FAKE_GPUS:-8}
KILL_WAIT=${SLURM_KILL_WAIT:-30}
CORES=$(nproc)
CPUS=${SLURM_CPUS:-$((4 * CORES > 8 ? 4 * CORES : 8))}
# Leave 1 GiB of the machine to the daemons and the submitting Snakemake.
MEM=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
MEM=$((MEM > 2048 ? MEM - 1024 : MEM))

# --- munge ---------------------------------------------------------------------------------------
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile /etc/munge/munge.key
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key; chmod 755 /run/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- munged
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n </dev/null | unmunge >/dev/null || { log "munged did not start (see /var/log/munge/munged.log)"; exit 1; }
fi

# --- configuration -------------------------------------------------------------------------------
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
new=$(mktemp)
cat >"$new" <<CONF
$MARK: a one-node test cluster ($HOST).
ClusterName=lrattnres
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# No systemd, no cgroups here: track job processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
# No accounting database: Snakemake's Slurm executor queries squeue (MinJobAge keeps finished jobs
# visible to it long enough).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=300
# Jobs may be requeued (Snakemake's --slurm-requeue, scontrol requeue, preemption).
JobRequeue=1
KillWait=$KILL_WAIT
# A requeued job may start again after cred_expire seconds (default 120).
AuthInfo=cred_expire=10
ReturnToService=2
MpiDefault=none
SchedulerParameters=sched_interval=2
GresTypes=gpu
# The node's CPUs as configured here, not as detected (oversubscribed on purpose, see SLURM_CPUS).
SlurmdParameters=config_overrides
NodeName=$HOST CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
# Fake GPUs: character devices equal to /dev/null stand in for the device files (no cgroups here, so
# nothing is constrained), so that jobs asking for GPUs are scheduled on a CPU machine.
newgres=$(mktemp)
if [ "$GPUS" -gt 0 ]; then
  for i in $(seq 0 $((GPUS - 1))); do [ -c "/var/spool/slurmd/fake-gpu$i" ] || mknod "/var/spool/slurmd/fake-gpu$i" c 1 3; done
  echo "NodeName=$HOST Name=gpu File=/var/spool/slurmd/fake-gpu[0-$((GPUS - 1))]" >"$newgres"
fi

changed=0
cmp -s "$new" /etc/slurm/slurm.conf || changed=1
cmp -s "$newgres" /etc/slurm/gres.conf || changed=1
install -m 644 "$new" /etc/slurm/slurm.conf
install -m 644 "$newgres" /etc/slurm/gres.conf
rm -f "$new" "$newgres"

# A daemon runs if its pid file names a live process of that name (a stale file after a reboot may
# name another process).
running() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$(basename "$1" .pid)" ]
}
if [ "$changed" = 1 ]; then
  for pf in /run/slurm/slurmd.pid /run/slurm/slurmctld.pid; do
    if running "$pf"; then
      pid=$(cat "$pf"); kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
  done
fi

# --- daemons -------------------------------------------------------------------------------------
# A fresh controller forgets the jobs of an earlier cluster (-c): after a reboot or a killed session
# they would otherwise be requeued, in folders that may be gone.
running /run/slurm/slurmctld.pid || slurmctld -c
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
scontrol ping | grep -q UP || { log "slurmctld did not start (see /var/log/slurm/slurmctld.log)"; exit 1; }
running /run/slurm/slurmd.pid || slurmd

# Wait for the node to register; make sure it advertises its (fake) GPUs and accepts jobs.
state=""
for _ in $(seq 150); do
  state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1)
  case "$state" in *'*') ;; idle*|mixed*|allocated*|completing*) break ;; esac
  case "$state" in drain*|down*|inval*|fail*) scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;; esac
  sleep 0.2
done
if ! scontrol show node "$HOST" | grep -q "Gres=gpu:$GPUS"; then
  scontrol update NodeName="$HOST" Gres="gpu:$GPUS"
fi
state=$(sinfo -h -n "$HOST" -o %T | head -1)
case "$state" in
  *'*') log "node $HOST is not responding ('$state'; see /var/log/slurm/slurmd.log)"; exit 1 ;;
  idle*|mixed*|allocated*|completing*) ;;
  *) log "node $HOST is '$state' (see /var/log/slurm/slurmd.log, slurmctld.log)"; exit 1 ;;
esac
log "up: node $HOST, $CPUS CPUs (on $CORES cores), $MEM MB, gpu:$GPUS, partition debug ($state)"
