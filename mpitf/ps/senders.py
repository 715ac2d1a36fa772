"""Who pushes to a ps: every replica, the in-graph clients, or one leader per node.

With node-local aggregation (``PsAssignment.nodes``, see mpitf/worker/node.py) a leader
pushes its node's summed gradients, so each push counts as that many replicas
(``weights``), and the leader's paused and done requests carry each replica's data position.
"""

import numpy as np

from ..wire import header as H
from ..wire import protocol as P


class Senders:
    """The ranks that push to a ps, by worker index, and what each push stands for."""

    def __init__(self, replica_ranks, clients=None, nodes=None):
        self.nodes = nodes
        heads = [n[0] for n in nodes] if nodes else clients
        self.ranks = [replica_ranks[i] for i in heads or range(len(replica_ranks))]
        self.index = {r: i for i, r in enumerate(self.ranks)}  # rank -> worker index
        # the replica whose data position a worker's push carries (keys of the checkpoint)
        self.replica_of = heads if nodes else range(len(self.ranks))
        self.weights = [len(n) for n in nodes] if nodes else None  # replicas per push

    def counters(self):
        """Return the fan-in counters: ranks that push, the replicas they stand for, pushes."""
        return dict(fan_in=len(self.ranks), pushes_received=0,
                    replicas=sum(self.weights) if self.weights else len(self.ranks))

    def capacity(self, capacity):
        """Return the receive capacity in bytes a ps's frames need (None: their own size)."""
        if not self.nodes:
            return capacity
        return max(capacity or 0, H.HEADER_BYTES + 8 * max(map(len, self.nodes)))

    def note_positions(self, positions, worker, request, frame):
        """Record the data position(s) a request carries in ``positions`` (replica -> pair).

        A push carries its sender's; a node leader's paused or done one word per replica.
        """
        if request.kind == P.PUSH:
            positions[self.replica_of[worker]] = (request.epoch, request.cursor)
        elif request.count and request.kind in (P.PAUSED, P.DONE) and self.nodes:
            end = H.HEADER_BYTES + 8 * request.count
            words = frame.bytes[H.HEADER_BYTES:end].view(np.int64).tolist()
            positions.update(zip(self.nodes[worker], map(H.split_position, words)))
