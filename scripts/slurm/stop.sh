#!/usr/bin/env bash
# Stop the one-node cluster of scripts/slurm/start.sh: cancel every job, stop slurmd and slurmctld
# (by their pid files). munged stays up (harmless; other tools may use it). Idempotent.
set -uo pipefail
export PATH="/usr/sbin:/sbin:$PATH"
[ "$(id -u)" = 0 ] || { echo "slurm/stop.sh: must run as root" >&2; exit 77; }
if scontrol ping 2>/dev/null | grep -q UP; then
  scancel --full --quiet --user root 2>/dev/null || true
fi
for pf in /run/slurm/slurmd.pid /run/slurm/slurmctld.pid; do
  if [ -s "$pf" ] && kill -0 "$(cat "$pf")" 2>/dev/null; then
    pid=$(cat "$pf"); kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
done
echo "slurm/stop.sh: stopped" >&2
