"""What listens on the network during a job (docs/reliability.md): mpitf nothing, MPI some.

The ports are read from /proc while a real 3-rank job that trained through mpitf is
still up. With the MPICH wheel, Hydra's control port (inherited by every rank) and UCX's
per-rank TCP listeners are all there is; UCX_TLS=self,sm removes UCX's on one node and
MPIEXEC_PORT_RANGE pins Hydra's, which leaves one port, in the range, that mpitf did not
open.
"""

import json

import pytest

from mpitf.testing import run_mpi
from tests.support import MPI_DRIVERS

DRIVER = str(MPI_DRIVERS / "sockets_driver.py")


def listeners(env=None):
    run = run_mpi(3, [DRIVER], timeout=90, env=env)
    assert run.returncode == 0, run.output
    line = next(x for x in run.stdout.splitlines() if x.startswith("listening: "))
    return {int(port): pids for port, pids in json.loads(line[len("listening: "):])}


@pytest.mark.mpi
def test_by_default_the_launcher_and_ucx_listen():
    ports = listeners()
    shared = [p for p, pids in ports.items() if len(pids) == 3]
    own = [p for p, pids in ports.items() if len(pids) == 1]
    assert len(shared) == 1, ports  # Hydra's control port, inherited by every rank
    assert len(own) >= 3, ports  # UCX: at least one listener per rank


@pytest.mark.mpi
def test_restricted_the_job_listens_on_one_port_in_the_given_range():
    ports = listeners({"UCX_TLS": "self,sm", "MPIEXEC_PORT_RANGE": "51000:51020"})
    assert len(ports) == 1, ports
    (port, pids), = ports.items()
    assert 51000 <= port <= 51020 and len(pids) == 3, ports
