"""One apply-and-reply: every policy, on a real Service whose communicator is a fake (no MPI).

A :class:`Wire` stands in for the communicator: it holds the requests the workers "sent"
(header words and payload, bytes), hands them to the ps's receive pool as MPI would
(``Improbe`` for the probing pool, persistent receives for a ps with one sender), and
copies every reply as its send starts. ``Service.run`` then serves the whole sequence,
as under mpiexec. Each policy's final parameters are checked against the update rule
worked out here; where the one-frame path (``AtOnce``) takes the pushes, the same run
through the general path (a timeline on: no one-frame update) gives the same parameters
and the same replies, byte for byte.
"""

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from mpitf.config import PsAssignment, TrainingConfig
from mpitf.errors import PeerError
from mpitf.placement import VariableSlice
from mpitf.ps.at_once import AtOnce
from mpitf.ps.consistency import Async, BoundedStaleness, DeterministicSync, SyncReplicas
from mpitf.ps.local import LocalAverage
from mpitf.ps.service import Service
from mpitf.wire import header as H
from mpitf.wire import protocol as P
from mpitf.wire.layout import bucket_ranges

SIZE = 6  # the shard: one variable of six float32 elements
LR = 0.1
RNG = np.random.default_rng(7)
INITIAL = RNG.standard_normal(SIZE).astype(np.float32)
GRADS = RNG.standard_normal((8, SIZE)).astype(np.float32)


class _Receive(MPI.Prequest):
    """A persistent receive (the one-sender pool's): filled from the wire when tested."""

    def __new__(cls, *args):  # a null request underneath: MPI's own calls find it complete
        return super().__new__(cls)

    def __init__(self, wire, buffer):
        self.wire, self.buffer, self.full = wire, buffer, False

    def Start(self):  # noqa: N802 - MPI's names
        self.full = False

    def Test(self):  # noqa: N802
        if not self.full and self.wire.inbox:
            _, data = self.wire.inbox.popleft()
            self.buffer[:len(data)] = np.frombuffer(data, np.uint8)
            self.full = True
        return self.full

    def Cancel(self):  # noqa: N802
        pass

    def Wait(self):  # noqa: N802
        pass

    def Free(self):  # noqa: N802
        pass


class _Send(MPI.Prequest):
    """A persistent send: each start copies what the frame holds then, as MPI would read it."""

    def __new__(cls, *args):
        return super().__new__(cls)

    def __init__(self, wire, buffer, dest):
        self.wire, self.buffer, self.dest = wire, buffer, dest

    def Start(self):  # noqa: N802
        self.wire.replies.append((self.dest, bytes(self.buffer)))

    def Test(self):  # noqa: N802
        return True

    def Free(self):  # noqa: N802
        pass


class _Message:
    def __init__(self, data):
        self.data = data

    def Irecv(self, buf):  # noqa: N802
        buf[0][:len(self.data)] = np.frombuffer(self.data, np.uint8)
        return MPI.Request()  # a null request: complete


class Wire:
    """The fake communicator: ``inbox`` (source rank, request bytes); ``replies`` as sent."""

    def __init__(self, requests):
        self.inbox = deque(requests)
        self.replies = []  # (dest rank, frame bytes)

    def Improbe(self, source, tag, status):  # noqa: N802
        if not self.inbox:
            raise AssertionError("the ps waits for a request the sequence does not have")
        source, data = self.inbox.popleft()
        status.Set_source(source)
        return _Message(data)

    def Recv_init(self, buf, source, tag):  # noqa: N802
        return _Receive(self, buf[0])

    def Send_init(self, buf, dest, tag):  # noqa: N802
        return _Send(self, buf[0], dest)

    def Isend(self, buf, dest, tag):  # noqa: N802
        self.replies.append((dest, bytes(buf[0])))
        return MPI.Request()


def request(kind, step, worker, payload=None, learning_rate=None):
    """Return the bytes of a request: its header words, then a float32 payload."""
    words = np.zeros(H.HEADER_WORDS, np.int64)
    count = 0 if payload is None else len(payload)
    H.pack_request(words, kind, step, worker, count, 0, 0, worker, learning_rate)
    body = b"" if payload is None else np.asarray(payload, np.float32).tobytes()
    return words.tobytes() + body


def serve(config, sequence, workers):
    """Run a Service over ``sequence`` ((worker, kind, step, payload, lr)); return it, wire."""
    ranks = list(range(1, workers + 1))  # worker w is rank w + 1; the ps is rank 0
    wire = Wire([(ranks[0], request(P.INIT, 0, 0, INITIAL))] +
                [(ranks[w], request(kind, step, w, payload, lr))
                 for w, kind, step, payload, lr in sequence] +
                [(r, request(P.DONE, 0, w)) for w, r in enumerate(ranks)])
    server = SimpleNamespace(comm=wire, replica_ranks=ranks, task_index=0, hosts=None, rank=0,
                             device="cpu", ulfm=False, job_comm=None,
                             peer=lambda rank, operation: dict(rank=rank, operation=operation))
    variable = VariableSlice("w", (SIZE,), "float32", 0, 0, SIZE, 0)
    assignment = PsAssignment(slices=(variable,), shard_size=SIZE, dtype="<f4", num_ps=1,
                              optimizer=dict(name="torch_sgd", learning_rate=LR), chief_rank=1)
    svc = Service(server, config.replace(ps_threads=1), assignment)
    assert svc.run() == 0
    assert not wire.inbox
    return svc, wire


def replies(wire, worker):
    """Return the (step, pushes applied, stale dropped, parameters) of each reply to ``worker``."""
    out = []
    for dest, data in wire.replies:
        if dest == worker + 1:
            head = H.unpack_reply(np.frombuffer(data[:H.HEADER_BYTES], np.int64))
            params = np.frombuffer(data[H.HEADER_BYTES:], np.float32)[:SIZE]
            out.append((head.step, head.pushes_applied, head.stale_dropped, params.tolist()))
    return out


def push(worker, step, k, lr=None):
    return (worker, P.PUSH, step, GRADS[k], lr)


# One worker: two steps, the second at a rate of 0.05; then a push of step 1 again
# (stale once two were applied) carrying a rate of 5; then step 2's.
ONE = [push(0, 0, 0), push(0, 1, 1, 0.05), push(0, 1, 2, 5.0), push(0, 2, 3)]
# Two workers: step 0 from both; worker 0's step 1 at 0.05; worker 1's late push of step 0
# at 5; worker 1's step 1; worker 0's step 2.
TWO = [push(0, 0, 0), push(1, 0, 1), push(0, 1, 2, 0.05), push(1, 0, 3, 5.0), push(1, 1, 4),
       push(0, 2, 5), push(1, 2, 6)]


def sgd(*steps):
    """Return the parameters after SGD steps ``(rate, gradient)`` from INITIAL, in float32."""
    p = INITIAL.copy()
    for rate, grad in steps:
        p -= np.float32(rate) * grad
    return p


def mean(*ks):
    acc = GRADS[ks[0]].copy()
    for k in ks[1:]:
        acc += GRADS[k]
    return acc / np.float32(len(ks)) if len(ks) > 1 else acc


# What each policy makes of the sequence: sync drops the stale push and keeps the rate it
# had (a dropped push changes nothing); async and ssp apply every push at its own rate.
CASES = {
    "sync, one worker": (TrainingConfig(mode="sync"), ONE, 1, SyncReplicas,
                         sgd((LR, GRADS[0]), (0.05, GRADS[1]), (0.05, GRADS[3])), 3, 1),
    "async, one worker": (TrainingConfig(mode="async"), ONE, 1, Async,
                          sgd((LR, GRADS[0]), (0.05, GRADS[1]), (5.0, GRADS[2]),
                              (5.0, GRADS[3])), 4, 0),
    "async, two workers": (TrainingConfig(mode="async"), TWO, 2, Async,
                           sgd(*[(r, GRADS[k]) for r, k in
                                 [(LR, 0), (LR, 1), (0.05, 2), (5.0, 3), (5.0, 4), (5.0, 5),
                                  (5.0, 6)]]), 7, 0),
    "sync, two workers": (TrainingConfig(mode="sync"), TWO, 2, SyncReplicas,
                          sgd((LR, mean(0, 1)), (0.05, mean(2, 4)), (0.05, mean(5, 6))), 3, 1),
    "deterministic sync": (TrainingConfig(mode="sync", deterministic=True), TWO, 2,
                           DeterministicSync,
                           sgd((LR, mean(0, 1)), (0.05, mean(2, 4)), (0.05, mean(5, 6))), 3, 1),
    "ssp": (TrainingConfig(mode="ssp", staleness=2), TWO, 2, BoundedStaleness,
            sgd(*[(r, GRADS[k]) for r, k in [(LR, 0), (LR, 1), (0.05, 2), (5.0, 3), (5.0, 4),
                                              (5.0, 5), (5.0, 6)]]), 7, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_policy_gives_its_rule_on_both_paths(case):
    config, sequence, workers, policy, expected, applied, dropped = CASES[case]
    svc, wire = serve(config, sequence, workers)
    assert type(svc.policy) is policy
    np.testing.assert_array_equal(svc.shard.params, expected)
    assert svc.state.counters["pushes_applied"] == applied
    assert svc.state.counters["stale_dropped"] == dropped
    assert svc.state.counters["pushes_received"] == len(sequence)
    assert svc.state.global_step == applied
    for w in range(workers):  # one reply per push (a dropped one's too)
        assert len(replies(wire, w)) == sum(1 for pushed, *_ in sequence if pushed == w)
    last = replies(wire, sequence[-1][0])[-1]  # the last push's: the final parameters
    assert last[:2] == (applied, applied) and last[3] == svc.shard.params.tolist()
    fast = svc.at_once is not None
    assert fast == (case in ("sync, one worker", "async, one worker", "async, two workers"))
    if fast:  # the general path (a timeline leaves no one-frame update) gives the same
        general, general_wire = serve(config.replace(timeline="unused"), sequence, workers)
        assert general.at_once is None
        np.testing.assert_array_equal(general.shard.params, expected)
        assert general.state.counters == svc.state.counters
        for w in range(workers):
            assert replies(general_wire, w) == replies(wire, w)


def test_a_stale_push_changes_nothing_on_either_path():
    # Sync's dropped push carried a rate of 5: taken, the next step would move 100x as far.
    # Its reply carries the parameters as they were; the drop is counted.
    for timeline in (None, "unused"):  # the one-frame path, then the general one
        svc, wire = serve(TrainingConfig(mode="sync", timeline=timeline), ONE[:3], 1)
        assert isinstance(svc.at_once, AtOnce) == (timeline is None)
        np.testing.assert_array_equal(svc.shard.params,
                                      sgd((LR, GRADS[0]), (0.05, GRADS[1])))
        assert svc.shard.optimizer.learning_rate(2) == 0.05
        assert svc.state.counters["stale_dropped"] == 1
        last = replies(wire, 0)[-1]
        assert last[:2] == (2, 2) and last[3] == svc.shard.params.tolist()


def test_local_sgd_averages_the_workers_parameters_every_k_steps():
    # Each worker pushes its parameters at steps 4 and 8 (K = 4): the ps puts their mean
    # in place, counts 4 steps per average, and answers both with it.
    a, b, c, d = (INITIAL + GRADS[k] for k in range(4))
    sequence = [(0, P.PUSH, 4, a, None), (1, P.PUSH, 4, b, None),
                (1, P.PUSH, 8, d, None), (0, P.PUSH, 8, c, None)]
    svc, wire = serve(TrainingConfig(mode="local", local_steps=4), sequence, 2)
    assert type(svc.policy) is LocalAverage and svc.at_once is None
    second = (c + d) / np.float32(2)
    np.testing.assert_array_equal(svc.shard.params, second)
    assert svc.state.global_step == 8 and svc.state.counters["pushes_applied"] == 2
    for w in range(2):
        first, last = replies(wire, w)[-2:]
        assert first[:2] == (4, 1) and first[3] == ((a + b) / np.float32(2)).tolist()
        assert last[:2] == (8, 2) and last[3] == second.tolist()


def test_local_sgd_refuses_parameters_of_another_step_naming_the_option():
    sequence = [(0, P.PUSH, 4, INITIAL, None), (1, P.PUSH, 3, INITIAL, None)]
    with pytest.raises(PeerError, match=r"parameters of step 3 .* expected step 4, as the "
                                        r"others did: every worker needs the same "
                                        r"--local-steps \(4\)"):
        serve(TrainingConfig(mode="local", local_steps=4), sequence, 2)


def test_a_clipped_step_holds_its_buckets_and_a_backup_workers_late_one_is_stale():
    # Sync, 3 workers, 2 a step, two 3-element buckets, and a clip norm that the workers
    # send in RATES (a torch loop's clip_grad_norm_): bucket 0 of step 0 is held once two
    # workers sent it; worker 2's, arriving then, is stale (dropped and answered); the last
    # bucket clips the mean of both and applies them in order. Step 1 sums fresh buckets.
    slices = (VariableSlice("a.w", (3,), "float32", 0, 0, 3, 0),
              VariableSlice("b.w", (3,), "float32", 0, 0, 3, 3))
    ranges = bucket_ranges(slices, SIZE, 12, 4)
    assert len(ranges) == 2
    clip = 0.5

    def part(worker, step, k, bucket):
        words = np.zeros(H.HEADER_WORDS, np.int64)
        lo, hi = ranges[bucket]
        H.pack_request(words, P.PUSH, step, worker, hi - lo, bucket=bucket, buckets=2)
        return worker + 1, words.tobytes() + GRADS[k][lo:hi].tobytes()

    def rates(worker):
        words = np.zeros(H.HEADER_WORDS, np.int64)
        H.pack_rates(words, worker, 1)
        return worker + 1, words.tobytes() + np.float64(clip).tobytes()

    sequence = [rates(0), rates(1), rates(2),
                part(0, 0, 0, 0), part(1, 0, 1, 0), part(2, 0, 2, 0),  # 2's: stale
                part(0, 0, 0, 1), part(1, 0, 1, 1), part(2, 0, 2, 1),  # clip, apply; stale
                part(1, 1, 3, 0), part(0, 1, 4, 0), part(0, 1, 4, 1), part(1, 1, 3, 1)]
    ranks = [1, 2, 3]
    wire = Wire([(1, request(P.INIT, 0, 0, INITIAL))] + sequence +
                [(r, request(P.DONE, 0, w)) for w, r in enumerate(ranks)])
    server = SimpleNamespace(comm=wire, replica_ranks=ranks, task_index=0, hosts=None, rank=0,
                             device="cpu", ulfm=False, job_comm=None,
                             peer=lambda rank, operation: dict(rank=rank, operation=operation))
    assignment = PsAssignment(slices=slices, shard_size=SIZE, dtype="<f4", num_ps=1,
                              optimizer=dict(name="torch_sgd", learning_rate=LR), chief_rank=1)
    config = TrainingConfig(mode="sync", replicas_to_aggregate=2, bucket_bytes=12,
                            ps_threads=1)
    svc = Service(server, config, assignment)
    assert svc.run() == 0 and not wire.inbox

    def clipped(g):
        norm = float(np.sqrt(np.vdot(g, g)))
        return g * np.float32(min(1.0, clip / (norm + 1e-6)))

    expected = sgd((LR, clipped(mean(0, 1))), (LR, clipped(mean(3, 4))))
    np.testing.assert_allclose(svc.shard.params, expected, rtol=1e-6)
    assert svc.state.counters["stale_dropped"] == 1 and svc.state.global_step == 2
    assert svc.clip.last_norm == pytest.approx(float(np.linalg.norm(mean(3, 4))), rel=1e-6)
    # every reply of the last step carries that norm (the worker's clip_grad_norm_ value)
    head = H.unpack_reply(np.frombuffer(wire.replies[-1][1][:H.HEADER_BYTES], np.int64))
    assert head.flags & P.FLAG_CLIPPED
    assert H.norm_of(head.max_lead) == svc.clip.last_norm
