"""The ps's receive pools (mpitf/ps/receive_pool.py): which one a ps takes, and both at work."""

import json
import re

import numpy as np
import pytest
from mpi4py import MPI

from mpitf.ps.receive_pool import PostedReceives, receive_pool
from mpitf.runtime.backend import numpy_backend
from mpitf.testing import run_mpi
from mpitf.wire import protocol as P
from mpitf.wire.frame import Frame
from tests.support import REPO


@pytest.mark.parametrize("senders, rerouted, ulfm, posted", [
    ([0], False, False, True),  # one worker: its receives are posted ahead
    ([0, 1], False, False, False),  # two may speak: matched probes
    ([0], True, False, False),  # a buddy's workers may be rerouted here
    ([0], False, True, False)])  # a dead worker's requests are told apart by probe
def test_a_ps_posts_receives_only_where_one_rank_may_send(senders, rerouted, ulfm, posted):
    frames = [Frame.allocate(numpy_backend(), 4, np.float32)]
    pool = receive_pool(MPI.COMM_SELF, frames, P.TAG_REQUEST, senders, rerouted, ulfm)
    try:
        assert isinstance(pool, PostedReceives) == posted
        assert not posted or (pool.source == 0 and len(pool.posted) == 1)
    finally:
        pool.close()


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, how", [(3, "probe"), (2, "posted")])
def test_frames_that_wait_in_mpi_come_in_order_from_each_sender(ranks, how):
    result = run_mpi(ranks, ["tests/mpi/pool_driver.py", "4", *(["posted"] if how == "posted"
                                                                else [])],
                     timeout=60, cwd=str(REPO))
    assert result.returncode == 0, result.output
    got = json.loads(re.search(r"^received: (.*)$", result.output, re.MULTILINE).group(1))
    assert got == {str(r): [100 * r + k for k in range(4)] for r in range(1, ranks)}
