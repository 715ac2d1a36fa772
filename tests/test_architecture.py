"""The package's shape: the layering contracts of pyproject.toml, sizes by idea, the public API."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mpitf
from tests.support import REPO

PACKAGE = REPO / "mpitf"


def lint_imports(root):
    """Run import-linter's contracts from pyproject.toml in ``root``; return (code, output)."""
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(cmd + ["--no-cache"], cwd=root, capture_output=True, text=True,
                          env=env, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_layering_contracts_hold():
    code, out = lint_imports(REPO)
    assert code == 0, out
    assert re.search(r"Contracts: (\d+) kept, 0 broken", out), out
    assert int(re.search(r"Contracts: (\d+) kept", out)[1]) >= 3


def test_the_layers_name_every_module():
    # A module the layering contract does not name may import anything: name each one.
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in contracts["contracts"] if c["id"] == "layers")["layers"]
    named = set(re.findall(r"mpitf\.\w+", " ".join(layers)))
    modules = {f"mpitf.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules |= {f"mpitf.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert modules - named == set()


def test_a_backward_import_breaks_the_layering(tmp_path):
    # The contracts must bite: a ps module that imports the worker side is refused.
    shutil.copytree(PACKAGE, tmp_path / "mpitf", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    shard = tmp_path / "mpitf" / "ps" / "shard.py"
    shard.write_text(shard.read_text() + "\nfrom ..worker import session  # noqa\n")
    code, out = lint_imports(tmp_path)
    assert code != 0, out
    assert "mpitf.ps.shard -> mpitf.worker.session" in out, out


# Size by idea, not by a line limit. A module grows past 300 lines only when it holds one idea
# that its docstring's first line names, and is listed here with that idea; a function past 50
# lines is listed with why it stays whole. Both lists must be exact: a listed module or
# function that has shrunk (or gone) is removed from the list, so the lists stay true.
LONG_MODULES = {
    "mpitf/bench/boxscaling.py": "the scaling suite over links: its grid, where it runs, its runs",
    "mpitf/bench/pushpull.py": "one benchmark: its arguments, the raw and mpitf loops, the JSON",
    "mpitf/cli/main.py": "the mpitf command's subcommands and their one parser",
    "mpitf/cluster/resolvers.py": "TF_CONFIG and the Slurm step, read as TensorFlow reads them",
    "mpitf/config.py": "every option of a job, declared once with its flag, help and check",
    "mpitf/models/layers.py": "the layers with hand-written gradients",
    "mpitf/placement.py": "which ps holds which variable or slice (TensorFlow's partitioners)",
    "mpitf/ps/consistency.py": "the consistency policies: sync, deterministic sync, async, ssp",
    "mpitf/ps/optimizers.py": "the ps's update rules",
    "mpitf/ps/service.py": "the ps's event loop, its state and what the policies call",
    "mpitf/runtime/backend.py": "numpy or CuPy behind one handle (the only CuPy import)",
    "mpitf/tables/rowkernels.py": "the compiled row loops of the tables",
    "mpitf/tables/dynkernels.py": "the compiled loops of the tables that grow",
    "mpitf/tables/rows.py": "row placement and dedup of a table's ids",
    "mpitf/testing/netcluster.py": "the cluster in a box: make, use and remove it",
    "mpitf/torch/optimizer.py": "mpitf.torch.DistributedOptimizer",
    "mpitf/worker/client.py": "the worker's flat buffers and its round trips to the ps",
    "mpitf/worker/buckets.py": "a push in buckets: sent as backward ends them, within a window",
    "mpitf/worker/embedding.py": "a worker's table lookups: dedup, pull, sum, push, grow",
    "mpitf/worker/session.py": "TrainingSession: start, steps, checkpoints, signals",
}
LONG_FUNCTIONS = {
    "mpitf/bench/overlap.py:worker": "one measurement loop whose timings share its locals",
    "mpitf/bench/pushpull.py:main": "the benchmark's rounds, in the order they interleave",
    "mpitf/bench/report.py:plot_all": "one figure per suite, each a few lines of matplotlib",
    "mpitf/bench/report.py:write_report": "the report's sections in the order they print",
    "mpitf/bench/runner.py:run_suites": "the suites in order, each a command and its result",
    "mpitf/bench/scaling_report.py:plots": "one figure per size and compute, then one scatter",
    "mpitf/bench/scaling_report.py:write_report": "the report's sections in the order they print",
    "mpitf/bench/sparse.py:main": "the sparse benchmark's phases, timed in one loop",
    "mpitf/ckpt/commands.py:describe_checkpoint": "mpitf ckpt show's lines in print order",
    "mpitf/ckpt/restore.py:load_shard": "one shard's pieces checked and copied in one pass",
    "mpitf/ckpt/write.py:write_shard": "one shard's file written and made durable in order",
    "mpitf/cli/main.py:build_parser": "argparse declarations, one per subcommand and flag",
    "mpitf/jobs/towers.py:main": "TensorFlow's tower trainer, kept in its program's order",
    "mpitf/ps/service.py:__init__": "the service's state, built in data-flow order",
    "mpitf/runtime/backend.py:select_backend": "the device decision and what it says, per case",
    "mpitf/runtime/cuda_aware.py:cuda_aware_support": "each MPI family's own test, in turn",
    "mpitf/tables/rowkernels.py:bitmap_unique": "a numba kernel: one pass, no calls inside",
    "mpitf/tables/dynkernels.py:hash_group": "a numba kernel: dedup and owner sort, no calls",
    "mpitf/testing/netcluster.py:main": "the box's subcommands and their parser",
    "mpitf/worker/client.py:__init__": "the flat buffers, views and frames, built in order",
    "mpitf/worker/embedding.py:lookup": "one pass over the tables, overlapped with the pulls",
    "mpitf/worker/session.py:__init__": "the session's options checked and its parts built",
}


def _module_lines():
    return {str(p.relative_to(REPO)): len(p.read_text().splitlines())
            for p in PACKAGE.rglob("*.py")}


def test_a_module_over_300_lines_holds_one_named_idea():
    sizes = _module_lines()
    assert sizes, "no modules found"
    long = {p for p, n in sizes.items() if n > 300}
    unlisted = long - set(LONG_MODULES)
    assert not unlisted, f"split these where their ideas split, or list each with its one " \
                         f"idea in LONG_MODULES: {sorted((p, sizes[p]) for p in unlisted)}"
    assert not set(LONG_MODULES) - long, "listed but no longer over 300 lines: remove them"
    over = {p: n for p, n in sizes.items() if n > 500}
    assert not over, f"over 500 lines: {over}"


def test_a_function_over_50_lines_is_listed_with_why_it_stays_whole():
    import ast

    long = {}
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 50:
                    long[f"{rel}:{node.name}"] = lines
    unlisted = set(long) - set(LONG_FUNCTIONS)
    assert not unlisted, f"split these, or list each with why it stays whole: " \
                         f"{sorted((f, long[f]) for f in unlisted)}"
    assert not set(LONG_FUNCTIONS) - set(long), "listed but no longer over 50 lines: remove them"


def test_public_names_resolve_and_are_documented():
    api = (REPO / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^\| `([A-Za-z_][\w]*)` \|", api, re.M))
    public = set(mpitf.__all__) - {"__version__"}
    assert public == documented, (sorted(public - documented), sorted(documented - public))
    for name in mpitf.__all__:
        assert getattr(mpitf, name) is not None, name


@pytest.mark.parametrize("name", ["TrainingSession", "Server", "make_optimizer"])
def test_public_names_are_loaded_on_first_use(name):
    # Importing mpitf must not initialise MPI: the heavy names load lazily.
    code = f"import sys, mpitf; assert 'mpi4py.MPI' not in sys.modules; mpitf.{name}"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
