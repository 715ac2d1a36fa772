"""A job that heals (``--heal``, Open MPI with ULFM): a lost rank is replaced by a spawned one.

A rank SIGKILLs itself at a step (``MPITF_TEST_KILL``, tests/recovery/slow_job.py: the kill
lands at that step, not at a time); the survivors shrink the job, spawn a replacement that
takes the lost rank and task, and the job (launched by `mpitf run`) ends at full strength:
every step run, the final summary counting every task, the accuracy within 0.02 of an
uninterrupted run.
"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from mpitf.config import JobFacts, TrainingConfig
from mpitf.errors import ConfigurationError
from mpitf.runtime.launch import openmpi_libmpi
from tests.support import (
    FINAL,
    JOB,
    REPO,
    cli_verify,
    final_summary,
    job_args,
    latest_step,
    mpitf_run_open_mpi,
    openmpi_mpiexec,
    run_job,
)

pytestmark = [pytest.mark.mpi]

STEPS, KILL_AT = 400, 150
DECAY = ["--lr-decay", "0.5", "--lr-decay-steps", "150"]  # see test_ulfm.py
HEAL = ["--heal"]
REPLICATE = ["--ps-replication-steps", "1"]
LOST = r"lost rank {r} \(/job:worker/task:{t} on \S+\) at step (\d+): "
REPLACED = (r"replaced rank {r} \(/job:worker/task:{t}\) by a spawned process on \S+ at step "
            r"(\d+), ([\d.]+) s after its loss \(the heal ([\d.]+) s\): (.*); 2 of 2 workers "
            r"train")
TAKES_OVER = (r"/job:worker/task:{t} replaces the lost task from step (\d+), its data at epoch "
              r"(\d+), example (\d+)")
BACK = {"sync": "sync steps aggregate 2 gradients again (replicas_to_aggregate 2)",
        "async": "its pushes count again"}

_WHOLE = {}  # mode -> the accuracy of an uninterrupted run


def mpitf_run(tmp_path, n, kills, timeout=150, env=None, **kw):
    """Run the slow job by ``mpitf run`` under Open MPI, ranks dying at ``kills``' steps."""
    return mpitf_run_open_mpi(["-n", str(n), JOB, *job_args(tmp_path, deterministic=False,
                                                             **kw)],
                              dict(env or {}, MPITF_TEST_KILL=kills), timeout)


def whole_run_accuracy(tmp_path_factory, mode, mpiexec, num_ps=1):
    """Return the accuracy of the job run uninterrupted (once per mode and ps count)."""
    if (mode, num_ps) not in _WHOLE:
        tmp = tmp_path_factory.mktemp(f"whole-{mode}-{num_ps}")
        whole = run_job(tmp, n=2 + num_ps, num_ps=num_ps, mode=mode, steps=STEPS,
                        mpiexec=mpiexec, deterministic=False,
                        extra=DECAY + HEAL + (REPLICATE if num_ps > 1 else []), timeout=120)
        assert whole.returncode == 0, whole.output
        _WHOLE[mode, num_ps] = final_summary(whole)["test_accuracy"]
    return _WHOLE[mode, num_ps]


@pytest.mark.slow
@pytest.mark.parametrize("mode,victim", [("sync", 2), ("async", 2), ("sync", 1)])
def test_a_killed_worker_is_replaced_and_the_job_ends_at_full_strength(tmp_path,
                                                                       tmp_path_factory, mode,
                                                                       victim):
    """Worker 1 (rank 2), or the chief (rank 1: worker 1 takes over its duties, its
    checkpoints among them, and keeps them; the replacement trains as worker 0)."""
    mpiexec = openmpi_mpiexec()
    expected = whole_run_accuracy(tmp_path_factory, mode, mpiexec)
    chief = victim == 1
    ckpt = tmp_path / "ckpt"
    run = mpitf_run(tmp_path, 3, f"rank{victim}@{KILL_AT}", mode=mode, steps=STEPS,
                    ckpt=ckpt if chief else None,
                    extra=DECAY + HEAL + (["--checkpoint-every", "100"] if chief else []))
    out = run.output
    assert run.returncode == 0, out
    names = dict(r=victim, t=victim - 1)
    lost, replaced, takes_over = (re.search(pattern.format(**names), out)
                                  for pattern in (LOST, REPLACED, TAKES_OVER))
    assert lost and replaced and takes_over, out
    assert int(lost.group(1)) >= KILL_AT - 5 and int(replaced.group(1)) >= int(lost.group(1))
    assert float(replaced.group(2)) >= float(replaced.group(3)) > 0, out
    assert replaced.group(4) == BACK[mode], out
    # the replacement starts from the ps's step (async: the chief trained on meanwhile)
    assert int(takes_over.group(1)) >= int(replaced.group(1)), out
    # its data position is the lost worker's, as the ps recorded it: mid-run, not the start
    assert (int(takes_over.group(2)), int(takes_over.group(3))) != (0, 0), out
    summary = final_summary(run)  # async: a push in flight at the last step may land too
    assert STEPS <= summary["step"] <= STEPS + 1, summary
    assert summary["workers"] == 2 and summary["ps"] == 1, summary
    assert abs(summary["test_accuracy"] - expected) <= 0.02, (summary, expected)
    if chief:  # one chief's lines: its successor's, checkpoints cut after the heal whole
        assert len(FINAL.findall(run.stdout)) == 1, out
        assert len(re.findall(r"^step 300, ", run.stdout, re.MULTILINE)) == 1, out
        assert latest_step(ckpt) == STEPS and cli_verify(ckpt).returncode == 0, out


WORKER_KILL = "rank3@225"  # worker 1 (rank 3), between the two ps losses
PS_LOST = re.compile(r"lost ps rank (\d) \(/job:ps/task:(\d) on \S+\) at step (\d+): "
                     r"/job:ps/task:(\d) serves its shard from its copy")
PS_REPLACED = re.compile(r"replaced rank (\d) \(/job:ps/task:(\d)\) by a spawned process on \S+ "
                         r"at step (\d+), ([\d.]+) s after its loss \(the heal ([\d.]+) s, its "
                         r"shard of [\d.e-]+ MiB handed over by /job:ps/task:(\d) in [\d.]+ s\): "
                         r"it serves its shard again and its copies resume")
PS_TAKES_OVER = re.compile(r"^\[rank (\d)\] WARNING /job:ps/task:(\d) replaces the lost task "
                           r"from step (\d+)$", re.MULTILINE)


@pytest.mark.slow
@pytest.mark.parametrize("mode,kills", [
    # ps task 1 killed, then worker 1 (rank 3), then ps 1's replacement; ps task 0 (rank 0),
    # then worker 1, then ps 0's buddy
    ("sync", "rank1@150,rank3@225,rank1@300"),
    ("async", "rank0@150,rank3@225,rank1@300"),
])
def test_a_killed_ps_is_replaced_and_its_pair_survives_a_second_loss(tmp_path,
                                                                     tmp_path_factory, mode,
                                                                     kills):
    mpiexec = openmpi_mpiexec()
    expected = whole_run_accuracy(tmp_path_factory, mode, mpiexec, num_ps=2)
    run = mpitf_run(tmp_path, 4, kills, num_ps=2, mode=mode, steps=STEPS,
                    extra=DECAY + HEAL + REPLICATE)
    out = run.output
    assert run.returncode == 0, out
    victims = [int(k.split("@")[0][4:]) for k in kills.split(",") if k != WORKER_KILL]
    lost, replaced = PS_LOST.findall(out), PS_REPLACED.findall(out)
    assert [int(r) for r, *_ in lost] == victims, out
    assert [int(r) for r, *_ in replaced] == victims, out
    for (rank, task, at, since, took, buddy), (_, _, lost_at, _) in zip(replaced, lost):
        # each ps's buddy served it, then handed its shard to the replacement
        assert int(buddy) == (int(task) + 1) % 2 and int(rank) == int(task), out
        assert int(at) >= int(lost_at) and float(since) >= float(took) > 0, out
    # worker 1 lost and replaced too, each ps saying so with its cost
    names = dict(r=3, t=1)
    worker_lost = re.findall(LOST.format(**names), out)
    worker_replaced = re.findall(REPLACED.format(**names), out)
    assert len(worker_lost) == 2 and len(worker_replaced) == 2, out
    assert all(int(at) >= 220 for at in worker_lost), out
    for at, since, took, back in worker_replaced:
        assert int(at) >= min(int(a) for a in worker_lost), out
        assert float(since) >= float(took) > 0 and back == BACK[mode], out
    takes_over = re.search(TAKES_OVER.format(**names), out)
    assert takes_over and (int(takes_over.group(2)), int(takes_over.group(3))) != (0, 0), out
    taken = PS_TAKES_OVER.findall(out)
    assert [(int(r), int(t)) for r, t, _ in taken] == [(v, v) for v in victims], out
    summary = final_summary(run)
    assert STEPS <= summary["step"] <= STEPS + 1, summary
    assert summary["workers"] == 2 and summary["ps"] == 2, summary
    assert abs(summary["test_accuracy"] - expected) <= 0.02, (summary, expected)


@pytest.mark.slow
def test_without_a_free_slot_the_job_goes_on_weakened(tmp_path):
    """A job that fills its slots (no --oversubscribe): the spawn fails, the job goes on."""
    mpiexec = openmpi_mpiexec()
    argv = [mpiexec, "--host", f"{socket.gethostname()}:3", "--bind-to", "none",
            "--with-ft", "ulfm", "--prtemca", "state_base_recoverable", "1",
            "-x", f"MPI4PY_LIBMPI={openmpi_libmpi(mpiexec)}", "-n", "3", sys.executable, JOB,
            *job_args(tmp_path, mode="sync", steps=STEPS, deterministic=False,
                      extra=DECAY + HEAL)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPITF_TEST_KILL=f"rank2@{KILL_AT}")
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env,
                         cwd=str(REPO), stdin=subprocess.DEVNULL)
    out = run.stdout + run.stderr
    assert "All nodes which are allocated for this job are already filled" in out, out
    assert re.search(r"^\[rank 0\] WARNING no process could be spawned to replace the lost "
                     r"ranks \(.*\): give the job free slots \(mpitf run oversubscribes\); it "
                     r"goes on without them$", out, re.MULTILINE), out
    finals = FINAL.findall(run.stdout)
    assert finals, out
    summary = json.loads(finals[-1])
    assert summary["step"] == STEPS and summary["workers"] == 1, summary
    # every rank ended 0, but PRRTE's mpiexec counts the failed spawn (seen: 213)
    assert run.returncode != 0 and "Traceback" not in out, out


def test_heal_without_ulfm_is_refused_on_every_rank(tmp_path):
    run = run_job(tmp_path, n=3, mode="async", steps=20, deterministic=False, extra=HEAL)
    assert run.returncode == 2, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("mpitf: error")]
    assert errors == ["mpitf: error on rank 0: heal (--heal) replaces a lost rank with a "
                      "spawned one, which needs Open MPI with ULFM (mpitf run --mpiexec <Open "
                      "MPI's mpiexec>); under this MPI a lost rank ends the job: drop the "
                      "option"], \
        run.output
    assert "Traceback" not in run.output, run.output


@pytest.mark.parametrize("options,what", [
    (dict(deterministic=True), "deterministic (--deterministic): a lost worker ends such a "
                               "job before a replacement could join; drop one of them"),
    (dict(aggregate_per_node=True), "aggregate_per_node (--aggregate-per-node); drop one of "
                                    "them"),
    (dict(clients=(0,)), "in-graph replication (clients); drop one of them"),
])
def test_heal_refuses_the_options_a_replacement_cannot_join(options, what):
    with pytest.raises(ConfigurationError) as refused:
        TrainingConfig(heal=True, **options)
    assert str(refused.value) == f"heal (--heal) does not support {what}"
    TrainingConfig(heal=True).check_job(JobFacts(num_ps=1, num_replicas=2, ulfm=True))
    with pytest.raises(ConfigurationError, match=r"^heal \(--heal\) replaces a lost rank "):
        TrainingConfig(heal=True).check_job(JobFacts(num_ps=1, num_replicas=2, ulfm=False))


@pytest.mark.slow
def test_a_replacement_that_dies_before_it_joins_ends_the_job_named_not_hung(tmp_path):
    """The survivors would wait in the merge forever: the heal's deadline ends every rank,
    each naming the heal."""
    run = mpitf_run(tmp_path, 3, f"rank2@{KILL_AT}", timeout=120, mode="sync", steps=STEPS,
                    extra=DECAY + HEAL, env={"MPITF_TEST_JOIN": "die",
                                             "MPITF_HEAL_DEADLINE": "20"})
    out = run.output
    assert run.returncode != 0, out
    assert "the heal (shrink, spawn, merge) did not finish within 20 s (MPITF_HEAL_DEADLINE)" \
        in out, out
    assert "final:" not in out, out
    for rank in (0, 1):  # the ps and the chief, each at its own deadline
        assert f"mpitf: error on rank {rank}: the heal (shrink, spawn, merge) did not " \
               "finish" in out, out
