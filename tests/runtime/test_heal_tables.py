"""A tables job with a lost ps and replication on (Open MPI with ULFM, `mpitf run`).

The ctr job (jobs/ctr.py, its tables on the ps tasks) on 2 ps and 2 workers with
``--ps-replication-steps 1``: each ps's copy to its buddy carries its tables' rows and
slots (ps/table_copy.py). A ps SIGKILLs itself at a step (``MPITF_TEST_KILL``,
tests/recovery/slow_job.py with ``MPITF_TEST_JOB=ctr.py``); its buddy adopts the copy and
serves its rows, sparse pulls and pushes re-routed there, and with ``--heal`` hands them
to a replacement. The job runs every step and its test AUC and log loss stay within a
tolerance of the uninterrupted run's.
"""

import json
import re

import pytest

from mpitf.data.ctr import synthetic_ctr
from tests.support import FINAL, JOB, mpitf_run_open_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS, KILL_AT = 200, 80
# Measured against the uninterrupted run (which repeats to the bit here), 18 runs with a
# ps lost at step 80 (the three cases below, and ps 0 with fixed tables): test AUC moved by
# at most 2.0e-4 and log loss by 5.2e-4 (the step the loss lands in varies: the copy of
# step 79 adopted, step 80's pushes re-sent to it or not); with the tables left out of the
# copy (the buddy serving initial rows from step 80, the dense part alone) by 8.5e-4 to
# 2.6e-3 (AUC) and 1.7e-3 to 2.1e-3 (log loss) in each of the three cases.
TOLERANCE = {"test_auc": 5e-4, "test_logloss": 1e-3}
GROWTH = ["--dynamic-tables", "--admit-min-count", "2", "--evict-after-steps", "30",
          "--evict-every", "10"]  # ids admitted by count: the counts travel in the copy too
PS_LOST = re.compile(r"lost ps rank (\d) \(/job:ps/task:(\d) on \S+\) at step (\d+): "
                     r"/job:ps/task:(\d) serves its shard from its copy of step (\d+)")
PS_REPLACED = re.compile(r"replaced rank (\d) \(/job:ps/task:(\d)\) by a spawned process on \S+ "
                         r"at step (\d+), ([\d.]+) s after its loss \(the heal ([\d.]+) s, its "
                         r"shard of [\d.e-]+ MiB handed over by /job:ps/task:(\d) in [\d.]+ s\)")


_WHOLE = {}  # dynamic -> the uninterrupted run's summary (--heal changes none of its values)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ctr") / "ctr.h5")
    synthetic_ctr(path, train=20000, test=3000, fields=3, rows=200, dense=2, seed=4)
    return path


def ctr_run(tmp_path, data, kills="", extra=(), dynamic=False, timeout=150):
    """Run the ctr job by ``mpitf run`` under Open MPI on 4 ranks (2 ps, 2 workers)."""
    argv = ["-n", "4", JOB, "--data", data, "--num-ps", "2", "--steps", str(STEPS),
            "--batch-size", "128", "--mode", "sync", "--eval-every", "0",
            "--ps-replication-steps", "1", "--run-dir", str(tmp_path / "run"), *extra]
    if dynamic:
        argv += GROWTH
    run = mpitf_run_open_mpi(argv, dict(MPITF_TEST_KILL=kills, MPITF_TEST_JOB="ctr.py"),
                             timeout)
    out, output = run.stdout, run.output
    assert run.returncode == 0, output
    finals = FINAL.findall(out)
    assert finals, output
    return json.loads(finals[-1]), output


@pytest.mark.parametrize("dynamic,heal,victim", [
    (False, True, 1),  # fixed tables, ps task 1 lost and replaced
    (True, True, 0),  # tables that grow, ps task 0 (rank 0) lost and replaced
    (True, False, 1),  # tables that grow, ps task 1 lost, served by ps 0 to the end
])
def test_a_lost_ps_with_tables_is_adopted_and_replaced(tmp_path, data, dynamic, heal, victim):
    extra = ["--heal"] if heal else []
    if dynamic not in _WHOLE:
        _WHOLE[dynamic] = ctr_run(tmp_path / "whole", data, extra=extra, dynamic=dynamic)[0]
    whole = _WHOLE[dynamic]
    summary, out = ctr_run(tmp_path / "lost", data, f"rank{victim}@{KILL_AT}", extra,
                           dynamic)
    lost = PS_LOST.findall(out)
    assert [(int(r), int(t), int(b)) for r, t, _, b, _ in lost] == \
        [(victim, victim, 1 - victim)], out
    at, copy_step = int(lost[0][2]), int(lost[0][4])
    # the step a re-routed request names: the ps's last reply, KILL_AT - 1 where the kill
    # beat its step's replies out; the copy of every step: one lost at most
    assert at >= KILL_AT - 1 and 0 <= at - copy_step <= 1, out
    replaced = PS_REPLACED.findall(out)
    assert [(int(r), int(b)) for r, _, _, _, _, b in replaced] == \
        ([(victim, 1 - victim)] if heal else []), out
    assert summary["step"] == STEPS and summary["workers"] == 2, summary
    for key, tolerance in TOLERANCE.items():
        assert abs(summary[key] - whole[key]) <= tolerance, (key, summary, whole)
