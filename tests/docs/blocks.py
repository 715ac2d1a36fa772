"""The code blocks of the documentation: found, classified, and which test runs each.

A shell or Python block on a page either runs in a test (listed in ``RUN``, keyed by its
page and its first line) or says on its first line why it does not, as a comment the reader
sees: ``# needs ...`` (a cluster, Slurm, root, a GPU, a quiet machine for a benchmark, a
fresh checkout) or ``# excerpt ...`` naming the program it is taken from, which runs in
the tests.
"""

import re

from tests.support import REPO

# The pages: the site's (docs/*.md), the two files it includes, and the README.
PAGES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")) + [
    "README.md", "slurm/README.md", "benchmarks/README.md"]
LANGUAGES = {"sh", "bash", "shell", "console", "python", "py"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)

# (page, first line of the block) -> the test that runs the block as written.
RUN = {
    ("README.md", "import sys"):
        "tests/jobs/test_readme.py::test_readme_training_script_runs_as_written",
    ("docs/quickstart.md", "import sys"):
        "tests/jobs/test_readme.py::test_readme_training_script_runs_as_written",
    ("docs/quickstart.md", "mpiexec -n 3 python jobs/mnist_mlp.py --num-ps 1 --steps 300 "
                           "--mode sync"):
        "tests/docs/test_examples.py::test_quickstart_mpiexec_and_mpitf_run",
    ("docs/tensorflow.md", "mpiexec -n 3 python jobs/mnist_mlp.py --ps_hosts=localhost:2222 \\"):
        "tests/docs/test_examples.py::test_tensorflow_cluster_flags",
    ("docs/tensorflow.md", "python tests/tutorials/mnist_replica.py --download_only   "
                           "# the data, once, before the tasks"):
        "tests/docs/test_examples.py::test_tensorflow_tutorial_started_as_tensorflow_starts_it",
    ("docs/checkpoints.md", "mpiexec -n 3 python jobs/mnist_mlp.py --checkpoint-dir ckpt "
                            "--checkpoint-every 100 --steps 1000"):
        "tests/docs/test_examples.py::test_checkpoint_commands",
    ("docs/checkpoints.md", "mpiexec -disable-auto-cleanup -n 3 python jobs/mnist_mlp.py "
                            "--steps 1000"):
        "tests/runtime/test_stalls.py::test_the_readme_launcher_line_names_a_killed_rank",
}


def code_blocks(page):
    """Return ``(language, code)`` of each fenced block of ``page`` (a path under REPO)."""
    return [(m[1], m[2]) for m in FENCE.finditer((REPO / page).read_text())]


def examples(page):
    """Return the shell and Python blocks of ``page``."""
    return [code for language, code in code_blocks(page) if language in LANGUAGES]


def block(page, first_line):
    """Return the one example of ``page`` whose first line is ``first_line``."""
    (found,) = [code for code in examples(page) if code.splitlines()[0] == first_line]
    return found
