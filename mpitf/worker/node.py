"""Node-local aggregation (``aggregate_per_node``): a node's replicas push as one.

The training replicas that share a node's memory form a *node* (``Split_type`` with
``COMM_TYPE_SHARED`` over the replicas, in replica order; the lowest replica leads). Its
members share one MPI shared-memory window: the parameter buffer, which every member's
client uses as its own (the leader's pull lands in it, the others read it: no copy), and
one gradient slot per member. A step: every member writes its gradient into its slot and
reaches the node's barrier; the leader sums the slots in replica order into its own slot
and pushes that, standing for the node's replicas (the ps learns the nodes at start-up and
divides by replicas, not pushes); the reply lands in the shared parameters and a second
barrier shows it to the others. The ps fan-in drops by the replicas per node.

``MPITF_NODE_SIZE=N`` (for tests of several nodes on one machine) groups the replicas in
blocks of N consecutive replica indices instead; each block must still share memory.
"""

import os
import time

import numpy as np
from mpi4py import MPI

from ..config import SERVER_FIRST
from ..errors import ConfigurationError
from ..runtime.exits import collective
from ..wire import header as H
from ..wire import protocol as P

_ALIGN = 64  # bytes: every region of the window starts on a cache line


def _aligned(nbytes):
    return -(-nbytes // _ALIGN) * _ALIGN


class NodeGroup:
    """A replica's node: its members, its leader, the shared window and its barriers.

    Collective over ``server.replica_comm`` (every replica builds one). ``nodes`` lists
    every node's replica indices, nodes in the order of their leaders; every replica
    computes the same list, and the chief hands it to each ps.
    """

    def __init__(self, server):
        replicas = server.replica_comm
        if replicas is None:
            raise ConfigurationError("aggregate_per_node groups training replicas; this "
                                     f"rank runs /job:{server.job_name}")
        self.server = server
        self.deadline = None if server.deadline is None else server.deadline * SERVER_FIRST
        index = server.replica_index
        self.nodes = node_plan(replicas.allgather(shared_domain(replicas)))
        mine = next(node for node in self.nodes if index in node)
        self.comm = replicas.Split(mine[0], index)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.leader = self.rank == 0
        self.members = mine  # replica indices, in replica order
        self.ranks = self.comm.allgather(server.rank)  # their ranks in server.comm
        self.win = None
        self._seq = 0
        self.fresh = True  # the next reduction follows start-up or a checkpoint
        self._pending = None  # the leader's share barrier, entered and not yet waited for

    @classmethod
    def for_session(cls, server, config):
        """Return the node of a session that aggregates per node, or None.

        What aggregation cannot do was refused before (``TrainingConfig.check_job``).
        """
        return cls(server) if config.aggregate_per_node else None

    # -- the window ----------------------------------------------------------------------

    def allocate(self, params_size, grads_size, dtype):
        """Allocate the node's window; return (parameters, this member's gradient slot).

        The window holds the node's barrier stamps, the parameter buffer (``params_size``
        elements) and one gradient slot of ``grads_size`` elements per member; the leader
        allocates it, the others map it, and it starts zeroed.
        """
        dtype = np.dtype(dtype)
        stamps = _aligned(8 * self.size)
        pbytes, gbytes = params_size * dtype.itemsize, grads_size * dtype.itemsize
        stride = _aligned(gbytes)
        total = stamps + _aligned(pbytes) + self.size * stride
        self.win = MPI.Win.Allocate_shared(total if self.leader else 0, 1, comm=self.comm)
        buf, _ = self.win.Shared_query(0)
        memory = np.frombuffer(buf, np.uint8, total)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        if self.leader:
            memory[...] = 0
        self.stamps = memory[:8 * self.size].view(np.int64)
        params = memory[stamps:stamps + pbytes].view(dtype)
        base = stamps + _aligned(pbytes)
        self.slots = [memory[base + i * stride:base + i * stride + gbytes].view(dtype)
                      for i in range(self.size)]
        self.sync(self.deadline, "node window set-up")
        return params, self.slots[self.rank]

    def close(self):
        """Wait for every member (they may still read the window), then free it."""
        if self.win is not None:
            self.sync(self.deadline, "end of training on the node")
            self.win.Unlock_all()
            self.win.Free()
            self.win = None

    # -- a step --------------------------------------------------------------------------

    def sync(self, deadline, operation, wait=True):
        """Barrier of the node's members, with a deadline that names a member not there.

        Memory written to the window before it is visible to every member after it.
        ``wait=False`` enters the barrier without waiting: the next one waits for it first.
        """
        self._finish_pending(deadline)
        self._seq += 1
        self.stamps[self.rank] = self._seq
        self.win.Sync()
        request = self.comm.Ibarrier()
        if not wait:
            self._pending = (request, operation)
            return
        P.wait_all([request], deadline, lambda i: self._missing(operation))
        self.win.Sync()

    def _finish_pending(self, deadline):
        if self._pending is not None:
            request, operation = self._pending
            self._pending = None
            P.wait_all([request], deadline, lambda i: self._missing(operation))

    def _missing(self, operation):
        """Name a member that has not reached the barrier this member waits at."""
        self.win.Sync()
        late = [i for i in range(self.size) if self.stamps[i] < self._seq] or [0]
        return self.server.peer(self.ranks[late[0]], operation)

    def reduce(self, frames, deadline, timeline=None):
        """Gradients in: wait for the members; the leader sums their slots into its own.

        ``frames`` are the segments ``(header, payload start, end)`` of the gradient
        layout: payloads are summed frame by frame in replica order (slot 0 += slot 1,
        += slot 2, ...), headers are left alone. Members wait 1/SERVER_FIRST of a ps's
        allowance, so a silent member is named before the ps names the leader; after
        start-up or a checkpoint (``fresh``: the chief opens files, writes) as long as a ps
        waits then.
        """
        start = time.perf_counter()
        limit = deadline  # None: wait forever
        if limit is not None:
            fresh = self.fresh and self.deadline is not None
            limit = self.deadline / SERVER_FIRST if fresh else deadline / SERVER_FIRST ** 2
        self.fresh = False
        self.sync(limit, "node reduction (its gradient)")
        if self.leader and self.size > 1:
            own = self.slots[0]
            for _, b, c in frames:
                acc = own[b:c]
                for slot in self.slots[1:]:
                    np.add(acc, slot[b:c], out=acc)
        if timeline is not None and timeline.enabled:
            timeline.add("node_reduce", start, time.perf_counter(), replicas=self.size)

    def share(self, deadline, timeline=None):
        """Parameters out: the leader's pull is in the shared buffer; every member may read.

        The others wait SERVER_FIRST times a worker's allowance: the leader, waiting on
        the ps, names a silent ps first. The leader does not wait: the members' reading is
        over when they reach the next reduction, whose barrier it waits for.
        """
        start = time.perf_counter()
        self.sync(None if deadline is None else deadline * SERVER_FIRST,
                  "node share (the leader's pull)", wait=not self.leader)
        if timeline is not None and timeline.enabled:
            timeline.add("node_share", start, time.perf_counter(), replicas=self.size)

    def positions(self, frames):
        """Leader: return each member's data position, as it packed it in its slot's header."""
        a, b, _ = frames[0]
        return np.array([H.unpack_request(slot[a:b].view(np.int64)).position
                         for slot in self.slots], np.int64)

    def relay(self, message):
        """Leader: hand the chief's checkpoint release on to the node's other members."""
        for rank in self.ranks[1:]:
            self.server.comm.send(message, dest=rank, tag=P.TAG_CONTROL)

    @property
    def leader_rank(self):
        """Return the rank (in ``server.comm``) of this node's leader."""
        return self.ranks[0]


def refuse_aggregation(config, job, why):
    """Raise, alike on every rank, if ``job`` (which cannot aggregate per node) was asked to."""
    if config.aggregate_per_node:
        raise collective(ConfigurationError(
            f"{job} does not support --aggregate-per-node ({why}); drop the flag"))


def nodes_problem(server):
    """Return why the replicas cannot be grouped by node, or None (collective).

    Every rank of ``server.comm`` calls it and gets the same answer: an
    ``MPITF_NODE_SIZE`` block that does not share memory is refused before training.
    """
    domains = server.comm.allgather(shared_domain(server.comm))
    try:
        node_plan([domains[r] for r in server.replica_ranks])
    except ConfigurationError as exc:
        return str(exc)
    return None


def shared_domain(comm):
    """Return the lowest rank of ``comm`` that shares memory with this one (collective)."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return min(shared.allgather(comm.Get_rank()))
    finally:
        shared.Free()


def node_plan(domains, size=None):
    """Return the nodes of replicas whose shared-memory domains are ``domains``, in order.

    ``domains[r]`` names replica r's memory domain. A node is the replicas of one domain in
    replica order, nodes in the order of their first replica; with ``size`` (default:
    ``MPITF_NODE_SIZE``, unset: None) blocks of ``size`` consecutive replicas instead, each
    within one domain. Pure: every rank gets the same nodes or the same error.
    """
    size = node_size() if size is None else size
    if size is None:
        nodes = {}
        for replica, domain in enumerate(domains):
            nodes.setdefault(domain, []).append(replica)
        return tuple(tuple(node) for node in nodes.values())
    blocks = tuple(tuple(range(lo, min(lo + size, len(domains))))
                   for lo in range(0, len(domains), size))
    for block in blocks:
        if len({domains[r] for r in block}) > 1:
            raise ConfigurationError(
                f"MPITF_NODE_SIZE={size} puts replicas {block[0]}..{block[-1]}, which do not "
                "share memory, in one node; a node's replicas must share memory (the window "
                "is shared memory): lower it or unset it")
    return blocks


def node_size():
    """Return ``MPITF_NODE_SIZE`` (replicas per node, for tests), or None when unset."""
    text = os.environ.get("MPITF_NODE_SIZE", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigurationError(f"MPITF_NODE_SIZE={text!r}: give a positive number of "
                                 "replicas per node, or unset it")
    return int(text)
