"""``GroupRates``: the learning rates (and clip norm) a worker asks every ps to apply.

One rate (``learning_rate``) travels in each push header. mpitf.torch's param groups each
keep their own learning rate, which a scheduler may change every step (mpitf/ps/groups.py
holds the groups on the ps); several travel in a ``RATES`` request, one float64 per
group, sent on the request tag before the push whenever a rate changed: MPI keeps a
pair's messages on one tag in order, so every ps has them when the push arrives. A loop
that clips (mpitf.torch's ``clip_grad_norm_``, sync mode) adds one more float64 after the
groups' rates, the norm the ps clips the step's mean gradient to (0: none; ps/clip.py).
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
    ``values``: several groups' rates (a tuple, one per group, or None); ``clip_norm``:
    the norm the ps clips the step to (0.0: none this step; None: the loop never clips).
    """

    def __init__(self):
        self.learning_rate = None
        self._values = self._clip_norm = None
        # Whether a RATES request goes before each push (when changed): an attribute, as
        # every push reads it and few loops set the two it follows.
        self.travels = False
        self._frame = None  # made once, at the first send
        self._sent_rates = self._sent_clip = None  # what the frame holds
        self._sends = None  # their sends in flight: completed before the frame is written

    @property
    def values(self):
        """The groups' rates, a tuple (None: one rate, in the push header)."""
        return self._values

    @values.setter
    def values(self, rates):
        self._values = rates
        self.travels = rates is not None or self._clip_norm is not None

    @property
    def clip_norm(self):
        """The norm the ps clips this step to (0.0: none this step; None: never)."""
        return self._clip_norm

    @clip_norm.setter
    def clip_norm(self, norm):
        self._clip_norm = norm
        self.travels = norm is not None or self._values is not None

    def send(self, link):
        """Send ``values`` (and ``clip_norm``) to every ps of ``link`` unless last sent."""
        rates, clip = self.values, self.clip_norm
        if (rates is None and clip is None) or (rates == self._sent_rates and
                                                 clip == self._sent_clip):
            return
        groups = 0 if rates is None else len(rates)
        count = groups + (clip is not None)
        if self._frame is None or self._frame.payload.size != count:
            self._frame = Frame.allocate(numpy_backend(), count, np.float64)
        if self._sends is not None:
            self._sends.wait_sends()
        frame = self._frame
        if groups:
            frame.payload[:groups] = rates
        if clip is not None:
            frame.payload[groups] = clip
        H.pack_rates(frame.header, link.worker, count)
        sends = []
        for rank in link.ranks:
            sends.extend(frame.isend(link.comm, rank, P.TAG_REQUEST))
        self._sent_rates, self._sent_clip = None if rates is None else tuple(rates), clip
        self._sends = PushPullHandle.over(link, [], sends, "rates")
