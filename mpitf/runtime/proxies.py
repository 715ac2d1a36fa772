"""How each node's MPI proxy ended, so ``mpitf run --hosts`` can name a lost node.

When a node is lost, Hydra ends the job with ``control_cb ... assert (!closed) failed``
and Open MPI's PRRTE with status 0 now and then; neither says which node went. So
``mpitf run`` starts each node's proxy through a launcher of its own, :class:`ProxyWatch`'s
script, that runs the real one (ssh, rsh, the user's ``--launcher`` or the one the
environment names) and appends ``HOST CODE`` to a log when the proxy ends. The first
proxy that ended by a signal or a lost connection is the lost node.
"""

import os
import shlex
import stat
import time

from .launch import is_openmpi, ranks_by_host

# Hydra's launchers that reach a node through a remote shell; the others (slurm, pbs,
# lsf, sge, fork, manual) start proxies their own way and are left alone.
_REMOTE_SHELLS = ("ssh", "rsh")
# Inside a batch job Hydra picks the batch system's launcher by itself.
_BATCH_JOBS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE")

WRAPPER = """#!/bin/sh
# mpitf run's launcher: starts a node's MPI proxy through {launcher}
# and appends "HOST CODE" to $MPITF_LAUNCH_LOG when it ends (mpitf/runtime/proxies.py).
if [ "$1" != "--mpitf-session" ]; then
    # In a session of its own, so that it outlives mpiexec's kill of its launchers (as a
    # job ends) and can still say how the node's proxy ended.
    setsid "$0" --mpitf-session "$@" &
    wait $!
    exit $?
fi
shift
# Hydra calls: LAUNCHER [ssh options] HOST COMMAND...; PRRTE: LAUNCHER HOST COMMAND...
while [ $# -gt 0 ]; do
    case "$1" in -*) shift ;; *) break ;; esac
done
host=$1
{launcher} "$@"
code=$?
{{ echo "$host $code" >> "$MPITF_LAUNCH_LOG"; }} 2>/dev/null
exit $code
"""


def real_launcher(mpiexec, launcher=None, environ=os.environ):
    """Return the command (a list) that reaches a node, or None where mpiexec uses no shell.

    ``launcher``: ``mpitf run --launcher``; else what the environment gives mpiexec
    (Open MPI: ``PRTE_MCA_plm_ssh_agent``; Hydra: ``HYDRA_LAUNCHER_EXEC``, or
    ``HYDRA_LAUNCHER`` when it is ssh or rsh, or nothing inside a batch job); else ssh.
    """
    if launcher:
        return shlex.split(launcher)
    if is_openmpi(mpiexec):
        agent = environ.get("PRTE_MCA_plm_ssh_agent", "ssh")
        return shlex.split(agent.split(":")[0])  # PRRTE's "ssh : rsh": the first it finds
    if environ.get("HYDRA_LAUNCHER_EXEC"):
        return shlex.split(environ["HYDRA_LAUNCHER_EXEC"])
    kind = environ.get("HYDRA_LAUNCHER")
    if kind is None and any(v in environ for v in _BATCH_JOBS):
        return None  # Hydra starts its proxies through the batch system there
    kind = kind or "ssh"
    return [kind] if kind in _REMOTE_SHELLS else None


class ProxyWatch:
    """The launcher script and log of one ``mpitf run`` over hosts, kept in ``directory``.

    ``env`` holds the variables that make mpiexec start its proxies through the script
    (empty when mpiexec's launcher is no remote shell); :meth:`lost_node` reads the log.
    """

    def __init__(self, directory, mpiexec, hosts, n, launcher=None, environ=os.environ):
        self.log = os.path.join(directory, "launch.log")
        self.hosts, self.n, self.mpiexec = hosts, n, mpiexec
        self.env = {"MPITF_LAUNCH_LOG": self.log}
        real = real_launcher(mpiexec, launcher, environ)
        if real is None:
            return
        script = os.path.join(directory, "launcher")
        with open(script, "w") as f:
            f.write(WRAPPER.format(launcher=shlex.join(real)))
        os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR)
        if is_openmpi(mpiexec):
            self.env["PRTE_MCA_plm_ssh_agent"] = script
        else:
            self.env.update(HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=script)

    def lost_node(self, code):
        """Return a line naming the node lost while the job ran (``code``: mpiexec's), or None.

        Open MPI's mpiexec (PRRTE) returns before its launchers end, and after a lost node
        now and then with status 0; Hydra's, failing on a lost proxy, may end before the
        lost node's launcher has written its line: both are waited for (2 s at most).
        """
        if self.hosts and (code != 0 or is_openmpi(self.mpiexec)):
            wait_for_launchers(self.log, self.hosts)
        return lost_node_message(self.log, self.hosts, self.n)


def wait_for_launchers(launch_log, hosts, timeout=2.0):
    """Wait until ``launch_log`` has a line for each of ``hosts`` (or ``timeout`` seconds)."""
    names = {h.partition(":")[0] for h in hosts}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(launch_log) as f:
                if names <= {line.split()[0] for line in f if line.strip()}:
                    return
        except OSError:
            pass
        time.sleep(0.01)


def lost_node_message(launch_log, hosts, n):
    """Return a line naming the node whose launcher ended first and badly, or None.

    ``launch_log`` holds ``HOST CODE`` lines, one as each node's proxy ends. The first
    one that failed is the node whose loss ended the job: Hydra then ends every other
    proxy.
    """
    try:
        with open(launch_log) as f:
            ended = [line.split() for line in f if line.strip()]
    except OSError:
        return None
    placed = ranks_by_host(hosts, n) if hosts else {}
    for host, code in (e for e in ended if len(e) == 2 and e[1].isdigit()):
        code = int(code)
        if code <= 128:  # it ended on its own (an abort ends every proxy that way)
            continue
        how = "the connection to it was lost" if code == 255 else \
            f"killed by signal {code - 128}"
        ranks = placed.get(host)
        on = ""
        if ranks:
            word = "rank" if len(ranks) == 1 else "ranks"
            on = f"; {word} {', '.join(map(str, ranks))} ran there"
        return (f"node {host} was lost: its MPI launcher proxy ended ({how}) while the job "
                f"ran, so mpiexec ended every other rank{on}")
    return None
