#!/usr/bin/env bash
# Stop what tests/slurm/start-slurm.sh or start-slurm-box.sh started, by the pids in its own pid
# files (never by name). Cancels every job first and waits for the queue to empty. Idempotent.
# --purge also wipes job state, spool and logs (munge key, conf and packages stay).
set -u; ROOT=${SLURM_TEST_ROOT:-/tmp/mpitf-slurm}; export SLURM_CONF=$ROOT/etc/slurm.conf
C=(env); [ -s "$ROOT/netns" ] && C=(ip netns exec "$(cat "$ROOT/netns")")  # clients run there
alive() { local p; p=$(cat "$1" 2>/dev/null) && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ] &&
  ! grep -q '^State:.*Z' "/proc/$p/status"; }
stop() { alive "$1" "$2" || return 0; kill "$(cat "$1")"
  for _ in $(seq 75); do alive "$1" "$2" || { echo "[stop-slurm] $2 stopped"; return 0; }; sleep 0.2; done
  kill -9 "$(cat "$1")"; echo "[stop-slurm] $2 killed"; }
if alive "$ROOT/run/slurmctld.pid" slurmctld; then   # cancel all jobs, wait until the queue is empty
  J=$("${C[@]}" squeue -h -o %A 2>/dev/null)
  # shellcheck disable=SC2086  # $J is a list of job ids
  [ -n "$J" ] && "${C[@]}" scancel $J
  for _ in $(seq 100); do [ -z "$("${C[@]}" squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.5; done; fi
for pid in "$ROOT"/run/slurmd*.pid; do stop "$pid" slurmd; done   # slurmd-NODE.pid on a box
stop "$ROOT/run/slurmctld.pid" slurmctld
for d in /proc/[0-9]*; do   # orphaned slurmstepd of THIS cluster (fd open on our slurmd*.log)
  [ "$(cat "$d/comm" 2>/dev/null)" = slurmstepd ] || continue
  for fd in "$d"/fd/*; do
    case $(readlink "$fd" 2>/dev/null) in
      "$ROOT"/log/slurmd.log|"$ROOT"/log/slurmd-*.log) kill -9 "${d#/proc/}"; break;;
    esac; done; done
stop "$ROOT/munge/run/munged.pid" munged
if [ "${1:-}" = --purge ]; then
  rm -rf "$ROOT"/{state,spool,run,log,munge/run,munge/munged.log,env.sh}
  rm -f "$ROOT"/{netns,client}; fi
echo "[stop-slurm] done"
