"""``GroupRates``: the learning rates a worker asks every ps to apply.

One rate (``learning_rate``) travels in each push header. mpitf.torch's param groups each
keep their own learning rate, which a scheduler may change every step (mpitf/ps/groups.py
holds the groups on the ps); several travel in a ``RATES`` request, one float64 per
group, sent on the request tag before the push whenever a rate changed: MPI keeps a
pair's messages on one tag in order, so every ps has them when the push arrives.
"""

import numpy as np

from ..runtime.backend import numpy_backend
from ..wire import header as H
from ..wire import protocol as P
from ..wire.frame import Frame
from .handles import PushPullHandle

__all__ = ["GroupRates"]


class GroupRates:
    """The rates to send and what was sent.

    ``learning_rate``: the one rate every push header carries (None: the ps's own);
    ``values``: several groups' rates (a tuple, one per group, or None).
    """

    def __init__(self):
        self.learning_rate = None
        self.values = None
        self._frame = None  # made once, at the first send
        self._sent = None  # the rates the frame holds
        self._sends = None  # their sends in flight: completed before the frame is written

    def send(self, link):
        """Send ``values`` to every ps of ``link`` unless they are the ones last sent."""
        rates = self.values
        if rates is None or rates == self._sent:
            return
        if self._frame is None:
            self._frame = Frame.allocate(numpy_backend(), len(rates), np.float64)
        if self._sends is not None:
            self._sends.wait_sends()
        frame = self._frame
        frame.payload[...] = rates
        H.pack_rates(frame.header, link.worker, len(rates))
        sends = []
        for rank in link.ranks:
            sends.extend(frame.isend(link.comm, rank, P.TAG_REQUEST))
        self._sent, self._sends = tuple(rates), PushPullHandle.over(link, [], sends, "rates")
