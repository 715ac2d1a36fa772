"""The package's shape: the layering contracts of pyproject.toml, module sizes, the public API."""

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


def test_no_module_is_over_400_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert sizes, "no modules found"
    over = {p: n for p, n in sizes.items() if n > 400}
    assert not over, f"split these modules: {over}"


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
