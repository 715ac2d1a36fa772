#!/usr/bin/env bash
# Start Slurm across the nodes of a cluster in a box (mpitf.testing.netcluster) that is up:
# slurmctld in the box's head namespace on the bridge's address, one slurmd per node in the
# node's network namespace, with the node's host name, its own /dev/shm and IPC, and its own
# spool, pid and log file. For tests/jobs/test_slurm_box.py, or by hand:
#
#   python -m mpitf.testing.netcluster up --nodes 3
#   tests/slurm/start-slurm-box.sh mtfbox              # BOX: the box's name
#   /tmp/mpitf-slurm-mtfbox/client sinfo               # clients run in the head namespace
#   SLURM_TEST_ROOT=/tmp/mpitf-slurm-mtfbox tests/slurm/stop-slurm.sh --purge
#   python -m mpitf.testing.netcluster down
#
# Packages and munged come from `start-slurm.sh --prepare` (same SLURM_TEST_ROOT, default
# /tmp/mpitf-slurm-BOX, every file under it). Clients (sbatch, srun, squeue, scontrol) must run
# in the head namespace with SLURM_CONF set: $SLURM_TEST_ROOT/client CMD... does both.
# The daemons are started with nsenter + unshare, not `ip netns exec`: that remounts /sys, and
# slurmd then finds no cgroup hierarchy. Slurm's ports are per network namespace, so this runs
# beside the single-node Slurm of start-slurm.sh (root namespace, 127.0.0.1).
# Idempotent: a second call only checks the daemons (and restarts them if the conf changed).
# Exit codes and knobs as start-slurm.sh (3: this machine cannot run Slurm).
set -euo pipefail
BOX=${1:?usage: start-slurm-box.sh BOX_NAME}
ROOT=${SLURM_TEST_ROOT:-/tmp/mpitf-slurm-$BOX}; T0=$(date +%s%N)
HERE=$(cd "$(dirname "$0")" && pwd)
log() { echo "[start-slurm-box] $*"; }
die() { echo "[start-slurm-box] ERROR: $*" >&2; exit 1; }
alive() { local p; p=$(cat "$1" 2>/dev/null) && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ] &&
  ! grep -q '^State:.*Z' "/proc/$p/status"; }
stop() { alive "$1" "$2" || return 0; kill "$(cat "$1")"
  for _ in $(seq 75); do alive "$1" "$2" || return 0; sleep 0.2; done; kill -9 "$(cat "$1")"; }

HEAD=$BOX-head; HOSTS=/etc/netns/$HEAD/hosts
[ -s "/run/mpitf-netcluster/$BOX/nodes" ] && [ -e "/var/run/netns/$HEAD" ] ||
  die "no box '$BOX' is up: python -m mpitf.testing.netcluster up --name $BOX"
read -r -a NODES <"/run/mpitf-netcluster/$BOX/nodes"
addr() { awk -v h="$1" '$2 == h { print $1 }' "$HOSTS"; }

# 1-2. packages and munged (exit code 3 when this machine cannot run Slurm passes through)
SLURM_TEST_ROOT=$ROOT bash "$HERE/start-slurm.sh" --prepare || exit $?
S=$ROOT/munge/run/munge.socket.2
mkdir -p "${NODES[@]/#/$ROOT/spool/}"

# 3. slurm.conf: every node gets this machine's hardware (they share it)
HW=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //; s/ RealMemory=.*//')
MEM=$(( $(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') * 9 / 10 ))
export SLURM_CONF=$ROOT/etc/slurm.conf
{ cat <<EOF
ClusterName=mpitfbox
SlurmctldHost=$HEAD($(addr "$HEAD"))
SlurmUser=root
AuthInfo=socket=$S,cred_expire=${SLURM_CRED_EXPIRE:-5}
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=2,bf_interval=5
MpiDefault=pmi2
JobRequeue=1
ReturnToService=2
KillWait=${SLURM_KILL_WAIT:-10}
EOF
  for n in "${NODES[@]}"; do echo "NodeName=$n NodeAddr=$(addr "$n") $HW RealMemory=$MEM"; done
  echo "PartitionName=box Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} >"$SLURM_CONF.new"
if cmp -s "$SLURM_CONF.new" "$SLURM_CONF"; then rm "$SLURM_CONF.new"
else   # changed: restart the daemons on the new conf
  for pid in "$ROOT"/run/slurmd*.pid; do stop "$pid" slurmd; done
  stop "$ROOT/run/slurmctld.pid" slurmctld
  mv "$SLURM_CONF.new" "$SLURM_CONF"; fi
echo "export SLURM_CONF=$SLURM_CONF" >"$ROOT/env.sh"
echo "$HEAD" >"$ROOT/netns"   # stop-slurm.sh runs its clients there
printf '#!/bin/sh\n# Run a Slurm client in box %s'"'"'s head namespace.\nSLURM_CONF=%s exec ip netns exec %s "$@"\n' \
  "$BOX" "$SLURM_CONF" "$HEAD" >"$ROOT/client"
chmod 755 "$ROOT/client"

# 4. daemons. In each: the namespace's host name and /etc/hosts (as `ip netns exec` gives),
# and on the nodes a /dev/shm and IPC of their own, so no shared memory crosses nodes.
in_ns() {  # NAMESPACE HOSTNAME UNSHARE_FLAGS COMMAND...
  local ns=$1 host=$2 flags=$3; shift 3
  # shellcheck disable=SC2086  # $flags is a list of options
  nsenter --net="/var/run/netns/$ns" unshare --uts --mount $flags sh -c '
    hostname "$1" && mount --bind "/etc/netns/$2/hosts" /etc/hosts || exit 1
    [ "$3" = --ipc ] && { mount -t tmpfs -o mode=1777 tmpfs /dev/shm || exit 1; }
    shift 3; exec "$@"' sh "$host" "$ns" "$flags" "$@"
}
alive "$ROOT/run/slurmctld.pid" slurmctld ||
  in_ns "$HEAD" "$HEAD" "" slurmctld -f "$SLURM_CONF" || die "slurmctld did not start"
for n in "${NODES[@]}"; do
  alive "$ROOT/run/slurmd-$n.pid" slurmd ||
    in_ns "$BOX-$n" "$n" --ipc slurmd -N "$n" -f "$SLURM_CONF" || die "slurmd on $n did not start"
done

# 5. wait until every node is idle
C=(ip netns exec "$HEAD")
want=$(printf '%s idle\n' "${NODES[@]}" | sort); st=""
for _ in $(seq 120); do
  st=$("${C[@]}" sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
  [ "$st" = "$want" ] && break; sleep 0.5; done
[ "$st" = "$want" ] || { tail "$ROOT"/log/slurm*.log >&2; die "nodes not ready: ${st:-no answer}"; }
K=${#NODES[@]}
got=$("${C[@]}" timeout 60 srun -N "$K" -n "$K" -t1 hostname | sort | tr '\n' ' ') ||
  die "srun smoke test failed"
[ "$got" = "$(printf '%s\n' "${NODES[@]}" | sort | tr '\n' ' ')" ] ||
  die "srun -N $K hostname answered '$got', not the box's nodes"
log "ready: nodes ${NODES[*]} of box $BOX after $(( ($(date +%s%N) - T0) / 1000000 )) ms;" \
  "clients: $ROOT/client CMD..."
