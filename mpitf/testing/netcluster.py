"""A cluster in a box: K "nodes" on this machine, joined by a real TCP network stack.

Each node is a Linux network namespace with one veth link into a bridge; every process
started on it gets its own host name (UTS), its own ``/dev/shm``, IPC and PIDs, so MPI
finds no shared memory between nodes and moves their bytes over TCP, as between the nodes
of a cluster. A link may be shaped to a rate (``tc ... tbf``). The nodes share this
machine's cores, each taking its share (cores // nodes, at least 1) as the default thread
count of its processes (``OMP_NUM_THREADS``, ``NPROC``). The bridge lives in a
*head* namespace of its own, where ``mpiexec`` runs: every address the box uses is inside
namespaces this module made, and nothing of it touches the machine's own network.

Hydra starts ranks on the nodes through its ssh launcher with this box's launcher
script (``-launcher ssh -launcher-exec SCRIPT``), Open MPI's PRRTE through the same script
as its ssh agent (``--prtemca plm_ssh_agent SCRIPT``, one ``prted`` daemon per node):
:meth:`Box.mpiexec` builds either command. Each node has a temporary directory of its own
(``TMPDIR``), where PRRTE and PMIx keep their session files, named after pids that the
nodes' PID namespaces repeat.

By hand (as root)::

    python -m mpitf.testing.netcluster up --nodes 3 --rate 1gbit
    python -m mpitf.testing.netcluster run -n 3 -- python jobs/hello.py --num-ps 1
    python -m mpitf.testing.netcluster down

Everything a box makes is named after it (namespaces ``NAME-head``, ``NAME-node1``, ...,
``/etc/netns/NAME-*``, its state under ``/run/mpitf-netcluster/NAME``), and a box owned
by a process that has died is swept away by the next :func:`Box.up` or ``down``.
"""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE_ROOT = Path("/run/mpitf-netcluster")
DEFAULT_NAME = "mtfbox"
SUBNET = "10.213.0"  # head .1, node k .(k + 1); routed nowhere outside the box
BRIDGE = "br0"
BURST = "512kb"  # tbf's bucket: about 4 ms at 1 Gbit/s
# A link's two queues: the switch port's (the bridge's end) holds 10 ms at the link's rate;
# a node's own (its NIC's) holds 1,000 full frames, as Linux's default transmit queue
# (txqueuelen 1000). A node's queue of 10 ms dropped the replies a ps sends to 8 workers
# at once (250 KB at 200 Mbit/s; a host's own queue makes TCP wait, not resend), and each
# drop stalled its TCP stream (benchmarks/README.md, "Scaling over links").
SWITCH_QUEUE = ("latency", "10ms")
NIC_QUEUE = ("limit", str(1000 * 1514))
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")

LAUNCHER = """#!/bin/sh
# Hydra's ssh launcher calls: SCRIPT [ssh options] HOST COMMAND...
while [ $# -gt 0 ]; do
    case "$1" in -*) shift ;; *) break ;; esac
done
host=$1; shift
case " {nodes} " in
    *" $host "*) ;;
    *) echo "netcluster: box {name} has no node '$host' (it has: {nodes})" >&2; exit 255 ;;
esac
# In a session of its own, so that the node's proxy outlives mpiexec's kill of its
# launchers as a job ends, and ends on its own (as a proxy over ssh does).
setsid "$(dirname "$0")/node" "$host" "$*" &
wait $!
"""

NODE = """#!/bin/sh
# Runs COMMAND on node HOST of box {name}: its network namespace, with a host name,
# /dev/shm, IPC, PIDs and TMPDIR of its own (so no shared memory crosses nodes).
TMPDIR="{state}/tmp-$1"
# The nodes share this machine's cores: unless mpiexec's caller chose, a node's processes
# take the node's share of them ({threads}) as their thread count (torch's OpenMP, XLA's
# NPROC), as on a node of that many cores; each taking every core oversubscribes them all.
OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{threads}}}"
NPROC="${{NPROC:-{threads}}}"
export TMPDIR OMP_NUM_THREADS NPROC
mkdir -p "$TMPDIR"
ip netns exec "{name}-$1" unshare --uts --mount --ipc --pid --fork --mount-proc \\
    sh -c 'hostname "$0" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec sh -c "$1"' \\
    "$1" "$2"
"""


class BoxError(RuntimeError):
    """The box cannot be made, used or found; the message says why and what to do."""


def _sh(*argv, check=True):
    """Run a command quietly; raise BoxError with its stderr when ``check`` and it fails."""
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise BoxError(f"{shlex.join(map(str, argv))} failed: {proc.stderr.strip()}")
    return proc


def unavailable():
    """Return why this machine cannot make a box (None when it can)."""
    if os.geteuid() != 0:
        return "the network box needs root (network namespaces)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"the network box needs '{tool}' (iproute2, util-linux)"
    probe = f"mtfprobe{os.getpid()}"
    made = _sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"this machine cannot make network namespaces: {made.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def _cmdline(pid):
    """Return a process's command line (NUL-separated bytes; empty once it has gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Box:
    """K nodes named ``node1``..``nodeK``, each on one (optionally shaped) link to a bridge.

    Args:
        nodes: how many nodes (1 to 16).
        rate: each link's rate both ways, as tc writes it (``1gbit``, ``500mbit``), or
            per node (``node1=1gbit,node2=1gbit``: the others unshaped); None: unshaped
            (veth runs at memory speed).
        name: the box's name, the prefix of everything it makes (lower-case letters and
            digits, at most 8).
    """

    def __init__(self, nodes=2, rate=None, name=DEFAULT_NAME):
        if not _NAME.match(name):
            raise BoxError(f"box name {name!r}: lower-case letters and digits, at most 8, "
                           "starting with a letter")
        if not isinstance(nodes, int) or not 1 <= nodes <= 16:
            raise BoxError(f"--nodes {nodes!r}: a box has 1 to 16 nodes")
        self.name = name
        self.nodes = [f"node{k}" for k in range(1, nodes + 1)]
        self.rate = rate
        self.rates = self._rates(rate)
        self.state = STATE_ROOT / name
        self.head = f"{name}-head"
        # each node's share of this machine's cores: its processes' default thread count
        self.threads = max(1, len(os.sched_getaffinity(0)) // nodes)

    def _rates(self, rate):
        """Return {node: rate} from ``rate`` (one for all, or ``node=rate,...``)."""
        if rate is None:
            return {}
        text = str(rate)
        if "=" not in text:
            pairs = [(node, text) for node in self.nodes]
        else:
            pairs = [tuple(p.strip().split("=", 1)) for p in text.split(",")]
        rates = {}
        for node, value in pairs:
            if not _RATE.match(value):
                raise BoxError(f"--rate {rate!r}: give a rate as tc writes it, e.g. 1gbit, "
                               "500mbit, 10gbit (or node1=1gbit,node2=1gbit)")
            self.namespace(node)
            rates[node] = value
        return rates

    # -- names -------------------------------------------------------------------------

    def namespace(self, node):
        """Return the network namespace of ``node``."""
        if node not in self.nodes:
            raise BoxError(f"box {self.name} has no node {node!r} (it has: "
                           f"{', '.join(self.nodes)})")
        return f"{self.name}-{node}"

    def address(self, node):
        """Return ``node``'s address on the box's network."""
        self.namespace(node)
        return f"{SUBNET}.{self.nodes.index(node) + 2}"

    @property
    def launcher(self):
        """Return the path of the script Hydra's ssh launcher runs to reach a node."""
        return self.state / "launch"

    # -- up and down -------------------------------------------------------------------

    def up(self, owner=None):
        """Make the box; return self. ``owner``: the pid whose death frees it (default: ours).

        A box of this name left by a dead owner is swept first; one whose owner lives is
        refused. On any failure everything made so far is removed.
        """
        sweep()
        if self.state.exists():
            pid = _owner(self.state)
            raise BoxError(f"box {self.name} is already up (owner pid {pid}); take it down "
                           f"first: python -m mpitf.testing.netcluster down --name {self.name}")
        self.state.mkdir(parents=True)
        (self.state / "owner").write_text(f"{owner or os.getpid()}\n")
        (self.state / "nodes").write_text(" ".join(self.nodes) + "\n")
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self):
        hosts = "".join(f"{self.address(n)}\t{n}\n" for n in self.nodes)
        hosts = f"127.0.0.1\tlocalhost\n{SUBNET}.1\t{self.head}\n{hosts}"
        for ns in [self.head, *map(self.namespace, self.nodes)]:
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
        _sh("ip", "-n", self.head, "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "-n", self.head, "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _sh("ip", "-n", self.head, "link", "set", BRIDGE, "up")
        for node in self.nodes:
            ns, port = self.namespace(node), f"b-{node}"
            _sh("ip", "-n", self.head, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", ns)
            _sh("ip", "-n", self.head, "link", "set", port, "master", BRIDGE, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            if node in self.rates:
                for where, dev, queue in ((ns, "eth0", NIC_QUEUE),
                                          (self.head, port, SWITCH_QUEUE)):
                    _sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                        "tbf", "rate", self.rates[node], "burst", BURST, *queue)
        for path, text in ((self.launcher, LAUNCHER), (self.state / "node", NODE)):
            path.write_text(text.format(name=self.name, nodes=" ".join(self.nodes),
                                        state=self.state, threads=self.threads))
            path.chmod(0o755)

    def reshape(self, rate):
        """Shape every link to ``rate`` (as tc writes it) from now on; the box must be up."""
        if not _RATE.match(str(rate)):
            raise BoxError(f"rate {rate!r}: give a rate as tc writes it, e.g. 200mbit")
        for node in self.nodes:
            for where, dev, queue in ((self.namespace(node), "eth0", NIC_QUEUE),
                                      (self.head, f"b-{node}", SWITCH_QUEUE)):
                _sh("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev,
                    "root", "tbf", "rate", rate, "burst", BURST, *queue)
            self.rates[node] = rate
        self.rate = rate

    def down(self):
        """Kill every process on the box and remove all it made; safe to call twice."""
        _teardown(self.name)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    # -- use ---------------------------------------------------------------------------

    def mpiexec(self, n, argv, hosts=None, mpiexec=None, extra=()):
        """Return the argv that runs ``argv`` on ``n`` ranks spread over ``hosts``.

        ``hosts``: node names, one per rank slot in order (Hydra's ``-hosts a,b`` places
        ranks round-robin over them one at a time; ``node1:2`` gives node1 two slots);
        default: every node, one slot each. Open MPI's ``mpiexec`` (PRRTE) gets its own
        options: ULFM, :meth:`openmpi_settings`, ``--map-by slot --host ...``.
        """
        from mpitf.runtime.launch import find_mpiexec, is_openmpi, openmpi_libmpi

        mpiexec = mpiexec or find_mpiexec()
        hosts = list(hosts or self.nodes)
        for h in hosts:
            self.namespace(h.split(":")[0])
        if is_openmpi(mpiexec):
            lib = openmpi_libmpi(mpiexec)
            options = ["--with-ft", "ulfm", *(["-x", f"MPI4PY_LIBMPI={lib}"] if lib else [])]
            for (kind, name), value in self.openmpi_settings().items():
                options += [f"--{kind}", name, value]
            options += ["--map-by", "slot", "--host", ",".join(hosts)]
        else:
            options = ["-launcher", "ssh", "-launcher-exec", str(self.launcher),
                       "-iface", BRIDGE, "-hosts", ",".join(hosts)]
        return ["ip", "netns", "exec", self.head, mpiexec, *options, *extra,
                "-n", str(n), *map(str, argv)]

    def openmpi_settings(self):
        """Return {(kind, name): value}: what makes Open MPI's PRRTE run on this box.

        PRRTE (``prtemca``) reaches each node through the launcher script as its ssh agent,
        one ``prted`` per node; the daemons' and the ranks' TCP (``mca``) keep to the box's
        subnet.
        """
        subnet = f"{SUBNET}.0/24"
        return {("prtemca", "plm_ssh_agent"): str(self.launcher),
                ("prtemca", "oob_tcp_if_include"): subnet,
                ("mca", "oob_tcp_if_include"): subnet,
                ("mca", "btl_tcp_if_include"): subnet}

    def env(self):
        """Return the variables that make mpiexec reach the nodes (for ``mpitf run --hosts``).

        Hydra's, and Open MPI's (:meth:`openmpi_settings` as ``PRTE_MCA_``/``OMPI_MCA_``).
        """
        prefix = {"prtemca": "PRTE_MCA_", "mca": "OMPI_MCA_"}
        return {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(self.launcher),
                "HYDRA_IFACE": BRIDGE,
                **{prefix[kind] + name: value
                   for (kind, name), value in self.openmpi_settings().items()}}

    def on_head(self, argv):
        """Return an argv that runs ``argv`` on the head, where the launcher runs."""
        return ["ip", "netns", "exec", self.head, *map(str, argv)]

    def pids(self, node, *needles):
        """Return the pids of the processes on ``node`` whose command lines hold ``needles``.

        ``needles`` are strings (none: every process of the node).
        """
        out = _sh("ip", "netns", "pids", self.namespace(node), check=False).stdout
        wanted = [str(n).encode() for n in needles]
        return [int(p) for p in out.split() if all(w in _cmdline(p) for w in wanted)]

    def kill_node(self, node, sig=signal.SIGKILL):
        """Send ``sig`` to every process on ``node`` (its launcher proxy included).

        SIGKILL goes to processes stopped first, so that none dies of another's death
        (the proxy of SIGPIPE) before its own signal, as a node losing power does.
        """
        killed = self.pids(node)
        for s in (signal.SIGSTOP, sig) if sig == signal.SIGKILL else (sig,):
            for pid in killed:
                try:
                    os.kill(pid, s)
                except ProcessLookupError:
                    pass
        return killed

    def cut_link(self, node):
        """Take ``node``'s link down at the bridge: its packets go nowhere from now on."""
        self.namespace(node)
        _sh("ip", "-n", self.head, "link", "set", f"b-{node}",
            "down")

    def restore_link(self, node):
        """Bring ``node``'s link back up at the bridge (after :meth:`cut_link`)."""
        self.namespace(node)
        _sh("ip", "-n", self.head, "link", "set", f"b-{node}", "up")

    def exec_argv(self, node, argv):
        """Return an argv that runs ``argv`` on ``node`` (as the launcher does)."""
        return [str(self.launcher), node, shlex.join(map(str, argv))]


def _owner(state):
    try:
        return int((state / "owner").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _teardown(name):
    """Remove box ``name``: its processes, namespaces, /etc/netns files and state."""
    namespaces = [ns for ns in _sh("ip", "netns", "list", check=False).stdout.split()
                  if ns.startswith(f"{name}-")]
    for _ in range(50):  # processes first, or a namespace outlives its name
        pids = [int(p) for ns in namespaces
                for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    for ns in namespaces:
        _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    for etc in Path("/etc/netns").glob(f"{name}-*") if Path("/etc/netns").exists() else []:
        shutil.rmtree(etc, ignore_errors=True)
    shutil.rmtree(STATE_ROOT / name, ignore_errors=True)


def sweep():
    """Remove every box whose owner has died (a killed test run's leftovers)."""
    if not STATE_ROOT.exists():
        return []
    swept = []
    for state in STATE_ROOT.iterdir():
        pid = _owner(state)
        if pid is None or not _alive(pid):
            _teardown(state.name)
            swept.append(state.name)
    return swept


def existing(name=DEFAULT_NAME):
    """Return the box ``name`` that is up, or raise BoxError."""
    state = STATE_ROOT / name
    if not state.exists():
        raise BoxError(f"no box {name} is up: python -m mpitf.testing.netcluster up first")
    box = Box(len((state / "nodes").read_text().split()), name=name)
    return box


def main(argv=None):
    """The command line: up, down, run, exec, status."""
    parser = argparse.ArgumentParser(
        prog="python -m mpitf.testing.netcluster",
        description="A cluster in a box: nodes in network namespaces joined by TCP (root).")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make a box (it stays up until 'down')")
    up.add_argument("--nodes", type=int, default=3, help="how many nodes (default 3)")
    up.add_argument("--rate", default=None,
                    help="each link's rate, e.g. 1gbit or 10gbit, or per node, e.g. "
                         "node1=1gbit,node2=1gbit (default: unshaped)")
    up.add_argument("--owner", type=int, default=1,
                    help="the pid whose death frees the box for the next up's sweep "
                         "(default 1: it stays until down)")
    shape = sub.add_parser("shape", help="shape every link of a box that is up to a rate")
    shape.add_argument("--rate", required=True, help="e.g. 200mbit")
    down = sub.add_parser("down", help="remove a box and every process on it")
    run = sub.add_parser("run", help="run a command under mpiexec across the box's nodes")
    run.add_argument("-n", type=int, required=True, help="number of ranks")
    run.add_argument("--hosts", default=None,
                     help="node names, each with an optional slot count, e.g. node1:2,node2:2"
                          " (default: every node, one slot each)")
    run.add_argument("--mpiexec", default=None,
                     help="the launcher: MPICH's Hydra (default: the one next to this Python)"
                          " or Open MPI's mpiexec (run under ULFM)")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    sub.add_parser("status", help="say which boxes are up")
    for p in (up, down, run, shape):
        p.add_argument("--name", default=DEFAULT_NAME, help=f"box name (default {DEFAULT_NAME})")
    args = parser.parse_args(argv)
    try:
        if args.command == "status":
            names = sorted(p.name for p in STATE_ROOT.iterdir()) if STATE_ROOT.exists() else []
            for name in names:
                nodes = (STATE_ROOT / name / "nodes").read_text().split()
                print(f"{name}: {' '.join(nodes)} (owner pid {_owner(STATE_ROOT / name)})")
            if not names:
                print("no box is up")
            return 0
        if args.command == "down":
            _teardown(args.name)
            sweep()
            return 0
        reason = unavailable()
        if reason:
            raise BoxError(reason)
        if args.command == "up":
            box = Box(args.nodes, args.rate, args.name).up(owner=args.owner)
            print(f"box {box.name} up: {', '.join(box.nodes)} "
                  f"({box.rate or 'unshaped'} links); launcher {box.launcher}")
            return 0
        box = existing(args.name)
        if args.command == "shape":
            box.reshape(args.rate)
            return 0
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            raise BoxError("run: give the command after --")
        hosts = args.hosts.split(",") if args.hosts else None
        return subprocess.call(box.mpiexec(args.n, command, hosts=hosts, mpiexec=args.mpiexec))
    except BoxError as err:
        print(f"netcluster: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
