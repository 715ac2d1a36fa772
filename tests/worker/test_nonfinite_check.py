"""``Client.nonfinite_gradient``: which variable holds NaN or Inf, and no false alarm.

One process, no ps: the client is built on ``COMM_SELF`` (it sends nothing here).
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpitf.placement import Placement
from mpitf.worker.client import Client


class _Server:
    """What a Client reads from its server when it is built."""

    comm = MPI.COMM_SELF
    replica_index = 0

    @staticmethod
    def ranks_of(job):
        return [0]

    @staticmethod
    def host_of(rank):
        return "here"


@pytest.fixture
def client():
    return Client(_Server(), Placement([("w", (8, 4), "float32"), ("b", (4,), "float32")], 1))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the sum's, then the search
def test_finite_gradients_name_nothing_even_where_their_sum_overflows(client):
    client.grads["w"][...] = 3e38  # finite, but a float32 sum of them is Inf
    client.grads["b"][...] = -3e38
    assert client.nonfinite_gradient() is None


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nan_or_inf_anywhere_names_its_variable(client, bad):
    client.grads["w"][...] = 1.0
    client.grads["b"][2] = bad
    assert client.nonfinite_gradient() == "b"
    client.grads["b"][2] = 0.0
    client.grads["w"][7, 3] = bad
    assert client.nonfinite_gradient() == "w"
