"""Which ps configurations take the one-frame path of mpitf/ps/at_once.py (pure, no MPI).

That the path gives the general path's results is what the training tests check: every
one-frame job of one worker (sync) or async takes it.
"""

from types import SimpleNamespace

import pytest

from mpitf.ps.at_once import AtOnce
from mpitf.ps.consistency import Async, BoundedStaleness, DeterministicSync, SyncReplicas


def service(policy, bucketed=False, tables=None, timeline=False, clip_norm=None, mode="sync"):
    return SimpleNamespace(policy=policy, pipeline=SimpleNamespace(bucketed=bucketed),
                           tables=tables, timeline=SimpleNamespace(enabled=timeline),
                           config=SimpleNamespace(clip_norm=clip_norm, mode=mode))


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
