"""Weak scaling over links: mpitf against MPI_Iallreduce, 1 to 8 workers, up to 16 nodes.

``mpitf bench --suite scaling --box 16 [--rate 200mbit]`` makes a cluster in a box of that
many nodes (root; :mod:`mpitf.testing.netcluster`), or ``--hosts h1,...,hK`` runs on those
machines; either way every configuration of the grid runs ``mpitf.bench.linkstep`` once,
each figure the median of its alternated rounds:

* workers 1, 2, 4, 8 x ps 1, 2, 4, 8 on nodes of their own (where W + P nodes exist) and
  beside the workers (P <= W, one ps per worker node);
* model sizes (default 4 and 16 MiB: 16 and 64 MiB scaled down by four with the link);
* emulated compute (a fixed wait per step, named so in every report) of 0 and of about a
  push+pull (the model's bytes at the measured link rate);
* mpitf in two bucket sizes, and the peer: the same workers moving the same bytes with
  MPI_Iallreduce in buckets, in the same run.

Beside each point: the cost model's projection (``costmodel.project``, and
``costmodel.allreduce_step`` for the peer) from the fabric measured between two nodes; per
(workers, size, compute) the planner's choice set against the measured best. On a box, a
link-bound point is measured again at half the rate first: if its time does not move with
the rate, the report says the runs were CPU-bound. Writes ``OUT/results.json``,
``OUT/report.md`` and PNG plots.
"""

import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from ..errors import ConfigurationError
from .linkfigures import BATCH, BUCKETS, LINK_BOUND, finish, link_rate, rate_bytes

WORKERS = (1, 2, 4, 8)
PS = (1, 2, 4, 8)
SIZES = (4 << 20, 16 << 20)
DEFAULT_RATE = "200mbit"


def parse_list(text, flag):
    """Return the positive integers of a comma-separated ``text``; raise naming ``flag``."""
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigurationError(f"{flag} {text!r}: expecting positive whole numbers, "
                                 "comma-separated")
    return values


def grid(nodes, workers, ps, placements=("own", "beside"), explicit=False):
    """Return the (workers, ps, placement) points that ``nodes`` nodes hold.

    ps on nodes of their own need W + P nodes, beside the workers W nodes (P <= W). With
    ``explicit`` lists, a point that does not fit is an error naming the nodes it needs.
    """
    points = []
    for placement in placements:
        for w in workers:
            for p in [w] if ps == "N" else ps:
                need = w + p if placement == "own" else w
                if placement == "beside" and p > w:
                    continue
                if need > nodes:
                    if explicit:
                        raise ConfigurationError(
                            f"{w} workers and {p} ps on nodes of their own need {need} nodes;"
                            f" {nodes} given" if placement == "own" else
                            f"{w} workers need {need} nodes; {nodes} given")
                    continue
                points.append((w, p, placement))
    if not points:
        raise ConfigurationError(f"no configuration fits on {nodes} nodes: one worker and "
                                 "one ps on nodes of their own need 2")
    return points


def hosts_for(nodes, w, p, placement):
    """Return the host of each rank slot: ps first, then workers (mpiexec -hosts order)."""
    if placement == "own":
        return nodes[:w + p]
    return nodes[:w]  # ranks go round the worker nodes: ps i and a worker on node i


class Launcher:
    """Where the ranks run: a box made here (a :class:`Box`), or hosts given."""

    def __init__(self, box=None, hosts=None):
        self.box, self.hosts = box, hosts
        self.nodes = box.nodes if box is not None else hosts

    def argv(self, n, hosts, command):
        """Return the argv that runs ``command`` on ``n`` ranks over ``hosts``."""
        if self.box is not None:
            return self.box.mpiexec(n, command, hosts)
        from ..runtime.launch import find_mpiexec, is_hydra

        mpiexec = find_mpiexec()
        flag = "-hosts" if is_hydra(mpiexec) else "--host"
        return [mpiexec, flag, ",".join(hosts), "-n", str(n), *command]


class Box:
    """A cluster in a box, driven through its command (``python -m mpitf.testing.netcluster``).

    Production code does not import the test helpers (pyproject's import contracts): the
    box is made, used, reshaped and removed by that command, owned by this process (a box
    whose owner died is swept by the next one made).
    """

    CLI = [sys.executable, "-m", "mpitf.testing.netcluster"]

    def __init__(self, nodes, rate):
        self.name = f"sc{os.getpid() % 1000000}"
        self.nodes = [f"node{k}" for k in range(1, nodes + 1)]
        self.rate = rate

    def _call(self, *args):
        proc = subprocess.run([*self.CLI, *args, "--name", self.name], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=300)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
            raise ConfigurationError(f"--box {len(self.nodes)}: cannot make the box: "
                                     f"{lines[-1].removeprefix('netcluster: ')}")

    def up(self):
        """Make the box; return self (ConfigurationError naming why it cannot be made)."""
        self._call("up", "--nodes", str(len(self.nodes)), "--rate", self.rate,
                   "--owner", str(os.getpid()))
        return self

    def reshape(self, rate):
        """Shape every link to ``rate``."""
        self._call("shape", "--rate", rate)

    def mpiexec(self, n, command, hosts):
        """Return the argv that runs ``command`` on ``n`` ranks over the box's ``hosts``."""
        return [*self.CLI, "run", "--name", self.name, "-n", str(n), "--hosts",
                ",".join(hosts), "--", *map(str, command)]

    def down(self):
        """Remove the box and every process on it."""
        subprocess.run([*self.CLI, "down", "--name", self.name], capture_output=True,
                       stdin=subprocess.DEVNULL, timeout=300)


def check_hosts(hosts):
    """Raise ConfigurationError naming the first host that does not resolve."""
    for host in hosts:
        try:
            socket.getaddrinfo(host, None)
        except (socket.gaierror, UnicodeError):
            raise ConfigurationError(f"--hosts: host {host!r} does not exist (its name does "
                                     "not resolve)") from None


def _run(cmd, log, timeout):
    """Run ``cmd``, appending its output to ``log``; return (exit code, seconds)."""
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, text = 124, f"{exc.stdout or ''}{exc.stderr or ''}timed out after {timeout} s\n"
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(map(str, cmd))}\n{text}# exit {code} after "
                f"{time.monotonic() - started:.1f} s\n\n")
    return code, time.monotonic() - started


def linkstep_argv(ps, sizes, computes, buckets, link_bytes, rounds, steps, out,
                  systems="mpitf,allreduce"):
    """Return the command of one point (``python -m mpitf.bench.linkstep ...``)."""
    return [sys.executable, "-m", "mpitf.bench.linkstep", "--num-ps", str(ps),
            "--sizes", ",".join(map(str, sizes)), "--compute-ms", ",".join(computes),
            "--link-bytes-per-s", f"{link_bytes:.6g}",
            "--bucket-bytes", ",".join(map(str, buckets)), "--rounds", str(rounds),
            "--steps", str(steps), "--warmup", "1", "--systems", systems, "--json", out]


def rate_check(launcher, box, rate, size, out, log):
    """Time one worker's link-bound step at ``rate`` and at half of it; return the facts."""
    nodes = launcher.nodes[:2]
    half = f"{rate_bytes(rate) * 8 / 2 / 1e6:g}mbit"
    times = {}
    for label, r in (("full", rate), ("half", half), ("full again", rate)):
        box.reshape(r)
        path = os.path.join(out, f"rate-{label.replace(' ', '-')}.json")
        code, _ = _run(launcher.argv(2, nodes, linkstep_argv(
            1, [size], ["0"], [BUCKETS[0]], rate_bytes(r), 1, 3, path, "mpitf")), log, 600)
        if code == 0:
            with open(path) as f:
                times[label] = json.load(f)["results"][0]["step_s"]
    box.reshape(rate)
    full = min(times.get("full", math.inf), times.get("full again", math.inf))
    ratio = times["half"] / full if "half" in times and full < math.inf else None
    return dict(rate=rate, half_rate=half, bytes=size, step_s=times, ratio=ratio,
                link_bound=ratio is not None and ratio >= LINK_BOUND)


def fabric(launcher, out, log):
    """Measure latency and bandwidth between the first two nodes; return the fabric dict."""
    path = os.path.join(out, "fabric.json")
    code, _ = _run(launcher.argv(2, launcher.nodes[:2], [sys.executable, "-m",
                                                         "mpitf.bench.fabric", "--quick",
                                                         "--json", path]), log, 600)
    if code != 0:
        raise RuntimeError(f"the fabric ping-pong failed; see {log}")
    with open(path) as f:
        fab = link_rate(json.load(f))
    with open(path, "w") as f:  # what mpitf bench --plan --fabric reads
        json.dump(fab, f, indent=1)
    return fab


# -- the run ----------------------------------------------------------------------------

def main(args):
    """Run the scaling grid over links; write the report; return 0, or 1 if a point failed."""
    from .runner import require_matplotlib

    require_matplotlib()
    rate = args.rate or DEFAULT_RATE
    link_bytes = rate_bytes(rate)
    nodes = args.box if args.box else None
    hosts = [h for h in args.hosts.split(",")] if args.hosts else None
    if nodes is None and not hosts:
        raise ConfigurationError("--suite scaling over links needs --box N or --hosts ...")
    if hosts:
        if any(not h for h in hosts):
            raise ConfigurationError(f"--hosts {args.hosts!r}: an empty host name")
        check_hosts(hosts)
    count = nodes or len(hosts)
    explicit = args.workers is not None or args.ps is not None
    workers = parse_list(args.workers, "--workers") if args.workers else list(WORKERS)
    ps = "N" if args.ps == "N" else parse_list(args.ps, "--ps") if args.ps else list(PS)
    placements = (args.placement or "own,beside").split(",")
    if not placements or set(placements) - {"own", "beside"}:
        raise ConfigurationError(f"--placement {args.placement!r}: expecting own, beside or "
                                 "own,beside")
    points = grid(count, workers, ps, placements, explicit=explicit)
    sizes = parse_list(args.sizes, "--sizes") if args.sizes else list(SIZES)
    quick = bool(args.quick)
    rounds, steps = (1, 2) if quick else (args.repeats or 2, 3)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "bench.log")
    open(log, "w").close()
    previous = signal.signal(signal.SIGTERM, _terminate)  # so the box comes down
    box = None
    try:
        if nodes:
            box = Box(nodes, rate).up()
        launcher = Launcher(box, hosts)
        return _measure(launcher, box, points, sizes, rate, link_bytes, rounds, steps,
                        quick, out, log, count)
    finally:
        if box is not None:
            box.down()
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def _measure(launcher, box, points, sizes, rate, link_bytes, rounds, steps, quick, out, log,
             count):
    started, load, fab = time.monotonic(), [os.getloadavg()], fabric(launcher, out, log)
    print(f"fabric: latency {fab['latency_s'] * 1e6:.0f} us, "
          f"{fab['bytes_per_s'] * 8 / 1e6:.0f} Mbit/s of payload", flush=True)
    rate_facts = rate_check(launcher, box, rate, max(sizes), out, log) if box else None
    if box is not None:
        print(f"rate check: {rate_facts['ratio'] or 0:.2f} x the step at half the rate "
              f"({'link-bound' if rate_facts['link_bound'] else 'NOT link-bound'})", flush=True)
    rows, errors, commands = [], [], []
    for w, p, placement in points:
        path = os.path.join(out, f"point-w{w}-p{p}-{placement}.json")
        argv = launcher.argv(w + p, hosts_for(launcher.nodes, w, p, placement), linkstep_argv(
            p, sizes, ["0", "link"], BUCKETS, fab["bytes_per_s"], rounds, steps, path))
        commands.append(shlex.join(map(str, argv)))
        code, seconds = _run(argv, log, 900)
        load.append(os.getloadavg())
        if code != 0:
            errors.append(f"W={w} P={p} {placement}: exit {code}; see {log}")
            print(f"W={w} P={p} {placement}: FAILED (exit {code})", flush=True)
            continue
        with open(path) as f:
            for r in json.load(f)["results"]:
                r.pop("steps", None)
                rows.append(dict(r, placement=placement))
        mp = min((r for r in rows[-len(sizes) * 6:] if r["system"] == "mpitf"
                  and r["bytes"] == max(sizes) and r["compute_s"] == 0),
                 key=lambda r: r["step_s"], default=None)
        ar = next((r for r in rows[-len(sizes) * 6:] if r["system"] == "allreduce"
                   and r["bytes"] == max(sizes) and r["compute_s"] == 0), None)
        if mp and ar:
            print(f"W={w} P={p} {placement:<6} {max(sizes) >> 20} MiB, no compute: mpitf "
                  f"{mp['step_s'] * 1e3:.0f} ms, allreduce {ar['step_s'] * 1e3:.0f} ms "
                  f"({seconds:.0f} s)", flush=True)
    results = dict(
        suite="scaling over links", compute="emulated (a fixed wait per step)",
        nodes=count, box=box is not None, rate=rate, link_bytes_per_s=link_bytes,
        hosts=None if box is not None else launcher.nodes,
        fabric=fab, rate_check=rate_facts, sizes=sizes, buckets=list(BUCKETS), batch=BATCH,
        rounds=rounds, steps=steps, quick=quick, points=rows, errors=errors, commands=commands,
        loadavg=load, seconds=time.monotonic() - started)
    finish(results, out)
    print(f"mpitf bench: wrote {out}/report.md and results.json in "
          f"{results['seconds']:.0f} s" + (f"; {len(errors)} point(s) failed" if errors
                                           else ""))
    for e in errors:
        print(f"mpitf bench: {e}", file=sys.stderr)
    return 1 if errors else 0

