"""Surviving a lost worker or ps: the time from a SIGKILL to the next completed step, under ULFM.

Runs tests/recovery/slow_job.py (jobs/mnist_mlp.py, 1 ps + 2 workers) under Open MPI with
``--with-ft ulfm`` and ``--log-every 1``, kills /job:worker/task:1 once the chief has
logged ``--kill-at``, and reads the chief's ``metrics.jsonl`` (a wall-clock time per
step): the gap from the kill to the first step logged after it, beside the median gap
between steps before the kill. ``--victim ps`` runs 2 ps with ``--ps-replication-steps 1``
and kills /job:ps/task:1 instead (its buddy, ps 0, serves its shard). ``--victim
node-ranks`` (root) runs 2 ps + 2 workers on a 2-node cluster in a box, node2 holding ps
task 1 and worker 1, and kills those two ranks at once; node2's Open MPI daemon is left
alive (with it, the job ends: docs/reliability.md), so this is not a node loss. ``--replication``
measures what replication costs: runs with no kill at each K of ``--ks`` (0: off), taken
in turn ``--repeat`` times, and prints each K's median step time. ``--heal`` replaces the
lost rank (``--victim ps0`` kills ps task 0, which holds the MLP's two weight matrices:
``--hidden H`` sizes its shard at 74 H float32) and reads the time from the loss to full
strength, and the shard's hand-over, from the job's ``replaced rank ...`` line. Open MPI
from ``.openmpi`` (``bash run.sh test`` installs it) or ``--mpiexec``:

    python benchmarks/lost_worker.py --mode sync --repeat 5
    python benchmarks/lost_worker.py --mode async --victim ps --repeat 5
    python benchmarks/lost_worker.py --mode sync --victim node-ranks --repeat 5
    python benchmarks/lost_worker.py --mode async --replication --ks 0 1 100 --repeat 3
    python benchmarks/lost_worker.py --mode sync --heal --hidden 56680 --repeat 3
    python benchmarks/lost_worker.py --mode sync --heal --victim ps0 --hidden 56680 --repeat 3
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mpitf.runtime.launch import mpiexec_command  # noqa: E402

ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


HEALED = re.compile(r"replaced rank \d+ \(/job:\w+/task:\d+\) by a spawned process on \S+ at "
                    r"step \d+, ([\d.]+) s after its loss \(the heal ([\d.]+) s"
                    r"(?:, its shard of ([\d.e+-]+) MiB handed over by \S+ in ([\d.]+) s)?")


def once(mpiexec, mode, steps, kill_at, step_sleep, tmp, victim="worker", k=None, box=None,
         extra=()):
    """Run one job, kill the victim at ``kill_at``; return (kill to next step, median step).

    ``kill_at`` None: no kill, (None, median step). ``k``: --ps-replication-steps (2 ps).
    ``box``: run on its node1 and node2, two ranks each (``victim`` "node-ranks").
    ``extra``: the job's further flags (``--heal``, ``--hidden``).
    """
    run_dir, pids = tmp / "run", tmp / "pids"
    pids.mkdir()
    num_ps = 1 if k is None else 2
    argv = [sys.executable, str(REPO / "tests" / "recovery" / "slow_job.py"), "--mode", mode,
            "--num-ps", str(num_ps), "--steps", str(steps), "--log-every", "1",
            "--run-dir", str(run_dir)]
    if k is not None:
        argv += ["--ps-replication-steps", str(k)]
    argv += list(extra)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPITF_TEST_STEP_SLEEP=str(step_sleep),
               MPITF_TEST_PID_DIR=str(pids), **ROOT_OK)
    metrics = run_dir / "metrics.jsonl"
    with open(tmp / "out.log", "w") as out:
        cmd = mpiexec_command(2 + num_ps, argv, mpiexec=mpiexec) if box is None else \
            box.mpiexec(2 + num_ps, argv, hosts=["node1:2", "node2:2"], mpiexec=mpiexec)
        proc = subprocess.Popen(cmd, stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                start_new_session=True)
    killed = None
    try:
        while kill_at is not None and not (
                metrics.exists() and any(json.loads(line)["step"] >= kill_at  # whole lines
                                         for line in metrics.read_text().split("\n")[:-1])):
            if proc.poll() is not None:
                raise SystemExit(f"the job ended first:\n{(tmp / 'out.log').read_text()}")
            time.sleep(0.001)
        if kill_at is not None:
            if box is not None:  # ps task 1 and worker 1 (ranks 2, 3; pids as seen here)
                victims = box.pids("node2", run_dir)
            else:
                name = {"ps": "rank1-ps-1", "ps0": "rank0-ps-0"}.get(
                    victim, f"rank{num_ps + 1}-worker-1")
                victims = [int((pids / f"{name}.pid").read_text())]
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            killed = time.time()
        code = proc.wait(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if code != 0:
        raise SystemExit(f"exit {code}:\n{(tmp / 'out.log').read_text()}")
    times = [json.loads(line)["time"] for line in metrics.read_text().splitlines()]
    if killed is None:
        gaps = [b - a for a, b in zip(times, times[1:])]
        return None, statistics.median(gaps)
    before = [t for t in times if t < killed]
    after = min(t for t in times if t >= killed)
    gaps = [b - a for a, b in zip(before, before[1:])]
    return after - killed, statistics.median(gaps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mpiexec", default=str(REPO / ".openmpi" / "bin" / "mpiexec"))
    parser.add_argument("--mode", default="sync", choices=["sync", "async"])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kill-at", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.005)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--victim", default="worker",
                        choices=["worker", "ps", "ps0", "node-ranks"])
    parser.add_argument("--heal", action="store_true",
                        help="replace the lost rank (--heal) and read the time to full strength")
    parser.add_argument("--hidden", type=int, default=None,
                        help="the MLP's hidden units (its shard on ps task 0: 74 H float32)")
    parser.add_argument("--replication", action="store_true",
                        help="no kill: the median step time at each K of --ks")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 100])
    args = parser.parse_args()
    if args.replication:
        steps = {k: [] for k in args.ks}
        for _ in range(args.repeat):
            for k in args.ks:  # in turn, so that drifts of the machine hit every K alike
                with tempfile.TemporaryDirectory() as tmp:
                    steps[k].append(once(args.mpiexec, args.mode, args.steps, None,
                                         args.step_sleep, Path(tmp), k=k)[1])
        for k, ts in steps.items():
            print(f"{args.mode}, 2 ps, --ps-replication-steps {k}: a step "
                  f"{statistics.median(ts) * 1e3:.2f} ms median of {len(ts)} runs' medians "
                  f"(min {min(ts) * 1e3:.2f}, max {max(ts) * 1e3:.2f})")
        return
    extra = (["--heal"] if args.heal else []) + \
        ([] if args.hidden is None else ["--hidden", str(args.hidden)])
    results, heals, box = [], [], None
    if args.victim == "node-ranks":
        from mpitf.testing import netcluster

        why = netcluster.unavailable()
        if why:
            raise SystemExit(f"--victim node-ranks: {why}")
        box = netcluster.Box(2, name=f"lw{os.getpid() % 1_000_000}").up()
    try:
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(once(args.mpiexec, args.mode, args.steps, args.kill_at,
                                    args.step_sleep, Path(tmp), args.victim,
                                    None if args.victim == "worker" else 1, box, extra))
                if args.heal:
                    found = HEALED.findall((Path(tmp) / "out.log").read_text())
                    if len(found) != 1:
                        raise SystemExit("--heal: no single 'replaced rank' line in the job's "
                                         f"output:\n{(Path(tmp) / 'out.log').read_text()}")
                    heals.append(found[0])
    finally:
        if box is not None:
            box.down()
    to_next = [r[0] for r in results]
    step = statistics.median(r[1] for r in results)
    victim = {"worker": "a worker", "ps": "a ps", "ps0": "ps task 0",
              "node-ranks": "node2's ranks (ps task 1, worker 1)"}[args.victim]
    if heals:
        full, heal = [float(h[0]) for h in heals], [float(h[1]) for h in heals]
        shard = f"; its shard of {heals[0][2]} MiB handed over in " \
            f"{statistics.median(float(h[3]) for h in heals):.2f} s median" if heals[0][2] else ""
        print(f"{args.mode}, {victim} killed and replaced: loss -> full strength "
              f"{statistics.median(full):.2f} s median (min {min(full):.2f}, max "
              f"{max(full):.2f}), the heal itself {statistics.median(heal):.2f} s{shard}; "
              f"{len(heals)} runs")
    print(f"{args.mode}, {victim} killed: kill -> next step "
          f"{statistics.median(to_next) * 1e3:.1f} ms median "
          f"(min {min(to_next) * 1e3:.1f}, max {max(to_next) * 1e3:.1f}) over {len(results)} "
          f"runs; a step before the kill: {step * 1e3:.1f} ms median")


if __name__ == "__main__":
    main()
