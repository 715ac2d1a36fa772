"""Which ps configurations take the one-frame path of mpitf/ps/at_once.py (pure, no MPI).

That the path gives the general path's results is what the training tests check: every
one-frame job of one worker (sync) or async takes it.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from mpitf.ps.at_once import AtOnce
from mpitf.ps.consistency import Async, BoundedStaleness, DeterministicSync, SyncReplicas
from mpitf.ps.receive_pool import receive_pool
from mpitf.runtime.backend import numpy_backend
from mpitf.wire import protocol as P
from mpitf.wire.frame import Frame


def service(policy, bucketed=False, tables=None, timeline=False, clip_norm=None, mode="sync"):
    shard = SimpleNamespace(reply=SimpleNamespace(unpublished=False), average_frame=None)
    return SimpleNamespace(policy=policy, pipeline=SimpleNamespace(bucketed=bucketed),
                           tables=tables, timeline=SimpleNamespace(enabled=timeline),
                           config=SimpleNamespace(clip_norm=clip_norm, mode=mode), shard=shard)


@pytest.mark.parametrize("svc", [
    service(SyncReplicas(1, 1)), service(SyncReplicas(1, 2)),
    service(Async(), mode="async"), service(Async(), clip_norm=1.0, mode="async")])
def test_pushes_applied_as_they_land_take_it(svc):
    assert isinstance(AtOnce.for_service(svc), AtOnce)


@pytest.mark.parametrize("svc", [
    service(SyncReplicas(2, 2)),  # the mean of two gradients
    service(DeterministicSync(1, 1)),
    service(SyncReplicas(1, 1, weights=[2])),  # a node's sum
    service(BoundedStaleness(2), mode="ssp"),
    service(SyncReplicas(1, 1), bucketed=True),
    service(SyncReplicas(1, 1), tables=object()),
    service(SyncReplicas(1, 1), timeline=True),
    service(SyncReplicas(1, 1), clip_norm=1.0)])
def test_everything_else_goes_the_general_way(svc):
    assert AtOnce.for_service(svc) is None


@pytest.mark.parametrize("senders, replica, loop", [
    ([0], None, True),  # one worker: the path runs the loop
    ([0, 1], None, False),  # two may speak: the service's loop, pushes handed here
    ([0], object(), False)])  # a buddy ring: the service's loop (it watches the buddy)
def test_the_path_runs_the_loop_of_a_ps_with_one_sender(senders, replica, loop):
    svc = service(SyncReplicas(1, 1))
    svc.replica = replica
    svc.pool = receive_pool(MPI.COMM_SELF, [Frame.allocate(numpy_backend(), 4, np.float32)],
                            P.TAG_REQUEST, senders)
    try:
        at_once = AtOnce.for_service(svc)
        assert at_once.runs_loop() == loop and at_once.plain
    finally:
        svc.pool.close()


def test_a_reply_frame_with_a_moving_average_goes_the_frames_way():
    svc = service(Async(), mode="async")
    svc.shard.average_frame = object()
    assert not AtOnce.for_service(svc).plain
