"""The ps's receive pools (mpitf/ps/receive_pool.py): which one a ps takes, and both at work."""

import json
import re
from types import SimpleNamespace

import pytest

from mpitf.ps.service import Service
from mpitf.testing import run_mpi
from tests.support import REPO


@pytest.mark.parametrize("workers, replication, ulfm, sender", [
    ([3], 0, False, 3),  # one worker: its receives are posted ahead
    ([3, 4], 0, False, None),  # two may speak: matched probes
    ([3], 5, False, None),  # a buddy's workers may be rerouted here
    ([3], 0, True, None)])  # a dead worker's requests are told apart by probe
def test_a_ps_posts_receives_only_where_one_rank_may_send(workers, replication, ulfm, sender):
    svc = SimpleNamespace(worker_ranks=workers)
    assert Service._only_sender(svc, SimpleNamespace(ulfm=ulfm),
                                SimpleNamespace(ps_replication_steps=replication)) == sender


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, how", [(3, "probe"), (2, "posted")])
def test_frames_that_wait_in_mpi_come_in_order_from_each_sender(ranks, how):
    result = run_mpi(ranks, ["tests/mpi/pool_driver.py", "4", *(["posted"] if how == "posted"
                                                                else [])],
                     timeout=60, cwd=str(REPO))
    assert result.returncode == 0, result.output
    got = json.loads(re.search(r"^received: (.*)$", result.output, re.MULTILINE).group(1))
    assert got == {str(r): [100 * r + k for k in range(4)] for r in range(1, ranks)}
