#!/usr/bin/env bash
# Start a real single-node Slurm (munged + slurmctld + slurmd) for tests/jobs/test_slurm.py.
#
# Debian 12 as root, no systemd: installs slurmctld, slurmd, slurm-client, munge and libpmix-dev
# with apt-get if missing, binds the daemons to 127.0.0.1 and keeps every file under
# $SLURM_TEST_ROOT (default /tmp/mpitf-slurm). Idempotent: a second call only checks the daemons.
# Afterwards clients need SLURM_CONF: `source $SLURM_TEST_ROOT/env.sh`.
# `start-slurm.sh --prepare` does only steps 1 and 2 (packages, munged under $SLURM_TEST_ROOT):
# start-slurm-box.sh uses it before it starts Slurm across the nodes of a cluster in a box.
#
# Exit codes: 0 ready; 1 Slurm failed to start; 3 this machine cannot run it (not root, no apt,
# package install failed). tests/jobs/test_slurm.py skips on 3 unless MPITF_TEST_SLURM=1.
# Knobs: SLURM_CRED_EXPIRE (default 5 s, Slurm's least: a requeued job restarts 6-30 s later, not
# over 2 min), SLURM_KILL_WAIT (default 10 s between SIGTERM and SIGKILL on cancel/timeout).
# Adapted from the recipe in shared/slurm-local (see its NOTES.md).
set -euo pipefail
ROOT=${SLURM_TEST_ROOT:-/tmp/mpitf-slurm}; T0=$(date +%s%N)
log() { echo "[start-slurm] $*"; }
die() { echo "[start-slurm] ERROR: $*" >&2; exit 1; }
unable() { echo "[start-slurm] CANNOT RUN SLURM HERE: $*" >&2; exit 3; }
alive() { local p; p=$(cat "$1" 2>/dev/null) && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ] &&
  ! grep -q '^State:.*Z' "/proc/$p/status"; }
stop() { alive "$1" "$2" || return 0; kill "$(cat "$1")"
  for _ in $(seq 75); do alive "$1" "$2" || return 0; sleep 0.2; done; kill -9 "$(cat "$1")"; }

[ "$(id -u)" = 0 ] || unable "needs root (daemons run as root, packages come from apt-get)"
mkdir -p "$ROOT"/{etc,state,spool,run,log,munge/run}; chmod 755 "$ROOT" "$ROOT/munge" "$ROOT/munge/run"

# 1. packages; libpmix-dev only supplies the libpmix.so that Slurm's mpi/pmix plugin dlopens
need=$(for p in slurmctld slurmd slurm-client munge libpmix-dev; do
  dpkg-query -W -f='${Status}' $p 2>/dev/null | grep -q 'ok installed' || echo -n "$p "; done)
if [ -n "$need" ]; then
  command -v apt-get >/dev/null || unable "missing packages ($need) and no apt-get"
  log "installing $need"
  # shellcheck disable=SC2086  # $need is a word list
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $need
  } >"$ROOT/log/apt.log" 2>&1 || unable "apt-get failed, see $ROOT/log/apt.log"
fi

# 2. munged with a private key and socket
M=$ROOT/munge; S=$M/run/munge.socket.2
[ -s "$M/munge.key" ] || mungekey -c -k "$M/munge.key"
alive "$M/run/munged.pid" munged || munged -S "$S" --key-file="$M/munge.key" \
  --log-file="$M/munged.log" --pid-file="$M/run/munged.pid" --seed-file="$M/munged.seed"
munge -S "$S" -n | unmunge -S "$S" >/dev/null || die "munge self-test failed"
if [ "${1:-}" = --prepare ]; then log "packages and munged ready (socket $S)"; exit 0; fi

# 3. slurm.conf from this machine's hardware (slurmd -C)
N=$(hostname -s); HW=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //; s/ RealMemory=.*//')
MEM=$(( $(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') * 9 / 10 ))
cat >"$ROOT/etc/slurm.conf.new" <<EOF
ClusterName=mpitf
SlurmctldHost=$N(127.0.0.1)
SlurmUser=root
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthInfo=socket=$S,cred_expire=${SLURM_CRED_EXPIRE:-5}
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd.log
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
NodeName=$N NodeAddr=127.0.0.1 $HW RealMemory=$MEM
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$ROOT/etc/slurm.conf; echo "export SLURM_CONF=$SLURM_CONF" >"$ROOT/env.sh"
if cmp -s "$SLURM_CONF.new" "$SLURM_CONF"; then rm "$SLURM_CONF.new"
else   # changed: restart the daemons on the new conf
  stop "$ROOT/run/slurmd.pid" slurmd; stop "$ROOT/run/slurmctld.pid" slurmctld
  mv "$SLURM_CONF.new" "$SLURM_CONF"; fi

# 4. daemons (they fork into the background and write their pid files)
alive "$ROOT/run/slurmctld.pid" slurmctld || slurmctld -f "$SLURM_CONF"
alive "$ROOT/run/slurmd.pid" slurmd || slurmd -f "$SLURM_CONF"

# 5. wait for the node to be usable; resume it if a previous run left it down/drained
st=""; for _ in $(seq 120); do st=$(sinfo -h -n "$N" -o %T 2>/dev/null || true)
  case $st in
    idle|mixed|allocated) break;;
    down*|drain*) scontrol update NodeName="$N" State=RESUME || true;;
  esac; sleep 0.5; done
case $st in idle|mixed|allocated) ;; *) tail "$ROOT"/log/slurm*.log >&2; die "node not ready: '$st'";; esac
timeout 60 srun -n1 -t1 true || die "srun smoke test failed"
log "ready: node $N $st after $(( ($(date +%s%N) - T0) / 1000000 )) ms; now: source $ROOT/env.sh"
