"""The ``mpitf`` command: in-process through main(), and once through the console script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpitf.cli.main import builtin_jobs, main, parse_spec
from tests.support import REPO

MPITF = Path(sys.executable).parent / "mpitf"
SPEC5 = "ps|localhost:2222;localhost:2223,worker|localhost:2224;localhost:2225;localhost:2226"


def table(out):
    """Return the rank -> (task, host) rows of `mpitf cluster` output."""
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].isdigit():
            rows[int(parts[0])] = (parts[1], parts[2])
    return rows


def test_cluster_flag_form(capsys):
    assert main(["cluster", "--spec", SPEC5]) == 0
    out = capsys.readouterr().out
    assert "5 ranks (2 ps, 3 worker) on 1 node" in out
    assert table(out) == {
        0: ("/job:ps/replica:0/task:0", "localhost"),
        1: ("/job:ps/replica:0/task:1", "localhost"),
        2: ("/job:worker/replica:0/task:0", "localhost"),
        3: ("/job:worker/replica:0/task:1", "localhost"),
        4: ("/job:worker/replica:0/task:2", "localhost"),
    }


def test_cluster_counts_spread_ps_over_nodes(capsys):
    assert main(["cluster", "--spec", "ps=2,worker=3", "--hosts", "n1,n1,n2,n2,n2"]) == 0
    rows = table(capsys.readouterr().out)
    assert rows[0] == ("/job:ps/replica:0/task:0", "n1")
    assert rows[2] == ("/job:ps/replica:0/task:1", "n2")
    assert [rows[r][0] for r in (1, 3, 4)] == [f"/job:worker/replica:0/task:{i}" for i in range(3)]


def test_cluster_tf_config_pins_tasks_to_hosts(capsys):
    tf_config = {"cluster": {"ps": ["b:1"], "worker": ["a:1", "b:2"]},
                 "task": {"type": "worker", "index": 0}}
    assert main(["cluster", "--spec", json.dumps(tf_config), "--hosts", "a,b,b"]) == 0
    rows = table(capsys.readouterr().out)
    assert rows == {0: ("/job:worker/replica:0/task:0", "a"),
                    1: ("/job:ps/replica:0/task:0", "b"),
                    2: ("/job:worker/replica:0/task:1", "b")}


def test_parse_spec_forms_agree():
    want = parse_spec("ps|localhost;localhost,worker|localhost")
    assert parse_spec("ps=2,worker=1") == want
    assert parse_spec('{"ps": 2, "worker": 1}') == want


@pytest.mark.parametrize("argv, words", [
    (["cluster", "--spec", "bogus"], ["cannot read --spec 'bogus'"]),
    (["cluster", "--spec", "ps=two,worker=1"], ["'ps=two'"]),
    (["cluster", "--spec", "ps|a:1,chief|b:1;c:1"], ["2 'chief' tasks"]),  # issue 14
    (["cluster", "--spec", "{not json"], ["not valid JSON"]),
    (["cluster", "--spec", SPEC5, "-n", "4"], ["5 tasks", "4 ranks"]),
    (["cluster", "--spec", "ps=1,worker=1", "--hosts", "a", "-n", "2"], ["--hosts names 1"]),
    (["cluster", "--spec", "worker|nosuchhost:1"], ["'nosuchhost'"]),
])
def test_cluster_bad_input_exits_2_with_one_message(capsys, argv, words):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("mpitf: error: ") == 1
    for word in words:
        assert word in captured.err


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["run", "jobs/hello.py"]) == 2  # -n is required
    assert main(["bench", "--suite", "nope"]) == 2
    capsys.readouterr()
    for bad, says in (("0", "must be at least 1, got 0"), ("x", "expecting a whole number")):
        assert main(["bench", "--quick", "--repeats", bad]) == 2
        assert f"argument --repeats: {says}" in capsys.readouterr().err
    for bad in ("mlp,resnet", ","):
        assert main(["bench", "--quick", "--models", bad]) == 2
        assert f"argument --models: expecting models among mlp,cnn, got {bad!r}" in \
            capsys.readouterr().err
    assert main(["--version"]) == 0
    assert "mpitf 0.1.0" in capsys.readouterr().out


def test_console_script_cluster():
    proc = subprocess.run([str(MPITF), "cluster", "--spec", "ps=1,worker=2"], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert table(proc.stdout)[2] == ("/job:worker/replica:0/task:1", "localhost")
    bad = subprocess.run([str(MPITF), "cluster", "--spec", "nope"], cwd=REPO,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.startswith("mpitf: error: ")


def test_run_dry_run_and_slurm_hint(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert main(["run", "-n", "3", "--dry-run", "jobs/hello.py", "--num-ps", "2"]) == 0
    captured = capsys.readouterr()
    cmd = captured.out.split()
    at = cmd.index("-n")
    assert cmd[at:at + 2] == ["-n", "3"] and cmd[-3:] == ["jobs/hello.py", "--num-ps", "2"]
    # Hydra gets -disable-auto-cleanup, so mpitf can name a rank that is killed.
    assert "-disable-auto-cleanup" in cmd[:at]
    assert "srun" in captured.err and "42" in captured.err


def test_run_missing_script_exits_2(capsys):
    assert main(["run", "-n", "2", "no/such/job.py"]) == 2
    assert "no such script: no/such/job.py" in capsys.readouterr().err


BUILTIN = ["ctr", "dlrm", "hello", "in_graph", "jax_mnist", "mnist_mlp", "towers"]


def test_builtin_jobs_are_the_modules_of_mpitf_jobs():
    assert builtin_jobs() == BUILTIN


def test_run_builtin_job_by_name_dry_run(capsys):
    assert main(["run", "-n", "3", "--dry-run", "mnist_mlp", "--steps", "50"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[cmd.index("-n"):cmd.index("-n") + 2] == ["-n", "3"]
    assert cmd[-5:] == [sys.executable, "-m", "mpitf.jobs.mnist_mlp", "--steps", "50"]


def test_run_unknown_job_exits_2_listing_the_builtin_jobs(capsys):
    assert main(["run", "-n", "2", "no_such_job"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("mpitf: error: unknown job 'no_such_job'")
    for name in BUILTIN:
        assert name in captured.err


def test_run_help_names_the_builtin_jobs(capsys):
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog
    assert "JOB" in out and "python -m mpitf.jobs.NAME" in out
    for name in BUILTIN:
        assert name in out


@pytest.mark.parametrize("script, module", [
    *((f"jobs/{name}.py", f"mpitf.jobs.{name}") for name in BUILTIN),
    *((f"benchmarks/{name}.py", f"mpitf.bench.{name}") for name in ("pushpull", "scaling",
                                                                     "modes", "sparse",
                                                                     "fabric")),
])
def test_checkout_scripts_launch_the_package_code(script, module):
    by_path = subprocess.run([sys.executable, str(REPO / script), "--help"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    by_module = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
    assert by_path.returncode == by_module.returncode == 0, by_path.stderr + by_module.stderr
    assert by_path.stdout == by_module.stdout and "usage: " in by_path.stdout
    bad = subprocess.run([sys.executable, str(REPO / script), "--no-such-flag"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr


@pytest.mark.mpi
def test_run_hello_under_mpiexec_and_pass_its_exit_code():
    ok = subprocess.run([str(MPITF), "run", "-n", "2", "jobs/hello.py"], cwd=REPO,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("Hello, distributed TensorFlow!") == 2
    bad = subprocess.run([str(MPITF), "run", "-n", "4", "jobs/hello.py",
                          f"--cluster_spec={SPEC5}"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "4 ranks" in bad.stderr


@pytest.mark.mpi
def test_run_builtin_job_by_name_from_any_directory(tmp_path):
    ok = subprocess.run([str(MPITF), "run", "-n", "2", "hello"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("Hello, distributed TensorFlow!") == 2


def test_data_digits(tmp_path, capsys):
    import h5py
    out = tmp_path / "digits.h5"
    assert main(["data", "digits", "--out", str(out)]) == 0
    assert "1438 training and 359 test samples" in capsys.readouterr().out
    with h5py.File(out, "r") as f:
        assert len(f["x_train"]) + len(f["x_test"]) == 1797
        assert f["x_train"].shape[1] == 64


def test_data_mnist_missing_files_exit_1(tmp_path, capsys):
    assert main(["data", "mnist", "--idx-dir", str(tmp_path), "--out", str(tmp_path / "m.h5")]) == 1
    assert "train-images-idx3-ubyte" in capsys.readouterr().err


def test_ckpt_calls_checkpoint_commands(tmp_path, monkeypatch):
    from mpitf.ckpt import commands as checkpoint
    calls = []
    monkeypatch.setattr(checkpoint, "cmd_ls", lambda root: calls.append(("ls", root)) or 0)
    monkeypatch.setattr(checkpoint, "cmd_show",
                        lambda root, step=None: calls.append(("show", root, step)) or 0)
    monkeypatch.setattr(checkpoint, "cmd_verify", lambda root: calls.append(("verify", root)) or 1)
    monkeypatch.setattr(checkpoint, "cmd_export", lambda root, out, step=None, write=None:
                        calls.append(("export", root, out, step, write)) or 0)
    d = str(tmp_path)
    assert main(["ckpt", "ls", d]) == 0
    assert main(["ckpt", "show", d, "--step", "7"]) == 0
    assert main(["ckpt", "verify", d]) == 1
    assert main(["ckpt", "export", d, "--out", "p.npz"]) == 0
    assert calls == [("ls", d), ("show", d, 7), ("verify", d),
                     ("export", d, "p.npz", None, None)]
    from mpitf.torch.export import write_state_dict  # .pt, or --format torch: torch's writer

    assert main(["ckpt", "export", d, "--out", "m.pt"]) == 0
    assert main(["ckpt", "export", d, "--out", "m.bin", "--format", "torch"]) == 0
    assert calls[-2:] == [("export", d, "m.pt", None, write_state_dict),
                          ("export", d, "m.bin", None, write_state_dict)]


def test_ckpt_missing_directory_exits_2(capsys):
    assert main(["ckpt", "ls", "/no/such/ckpt"]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_bench_without_module_is_a_clear_error(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mpitf.bench.runner" else real(name, *a))
    assert main(["bench", "--quick", "--suite", "pushpull"]) == 1
    assert "mpitf.bench.runner" in capsys.readouterr().err


def test_bench_without_matplotlib_stops_at_once_naming_the_extra(tmp_path):
    """matplotlib hidden (a None entry in sys.modules makes its import fail): one line, exit 1."""
    out = tmp_path / "report"
    # Deadlines, not timings: main() itself has 1 s (interpreter start-up aside: an alarm
    # ends the process, whose exit code is then not 1), the whole process 10 s, on a loaded
    # machine (subprocess's timeout).
    code = ("import signal, sys; sys.modules['matplotlib'] = None; "
            "from mpitf.cli.main import main; signal.setitimer(signal.ITIMER_REAL, 1.0); "
            "code = main(); signal.setitimer(signal.ITIMER_REAL, 0); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, "bench", "--quick", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=10)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("mpitf: error: ")
    assert "pip install 'mpitf[bench]'" in proc.stderr and "matplotlib" in proc.stderr
    assert not out.exists()  # no suite ran: the report directory was never made
