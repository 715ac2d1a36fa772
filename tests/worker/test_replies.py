"""A round of ps replies read into one Reply (mpitf/worker/handles.py; pure, no MPI)."""

from types import SimpleNamespace

import numpy as np
import pytest

from mpitf.errors import PeerError
from mpitf.runtime.backend import numpy_backend
from mpitf.wire import header as H
from mpitf.wire import protocol as P
from mpitf.wire.frame import Frame
from mpitf.worker.handles import Replies, Reply


def replies(headers):
    """Return Replies over one reply frame per ps, each holding its header's words."""
    frames = []
    for step, flags, applied, dropped, staleness, lead in headers:
        frame = Frame.allocate(numpy_backend(), 4, np.float32)
        H.pack_reply(frame.header, step, len(frames), flags, applied, dropped, staleness, lead)
        frames.append(frame)
    link = SimpleNamespace(steps=[0] * len(frames),
                           describe=lambda p: {"rank": p, "job": "ps", "task": p})
    return Replies(link, frames, SimpleNamespace(converts=False), SimpleNamespace(split=False))


def test_one_ps_reply_is_its_words():
    got = replies([(7, P.FLAG_PAUSE, 30, 4, 5, 2)])
    assert got.finish() == Reply(7, P.FLAG_PAUSE, 4, 30, 5, 2)
    assert got.link.steps == [7]


def test_several_ps_replies_add_up():
    """The smallest step, every flag, the sums of the counts, the largest staleness and lead."""
    got = replies([(7, 0, 30, 4, 5, 0), (6, P.FLAG_PAUSE, 31, 1, 2, 3), (8, 0, 29, 0, 9, 1)])
    assert got.finish() == Reply(6, P.FLAG_PAUSE, 5, 90, 9, 3)
    assert got.link.steps == [7, 6, 8]


@pytest.mark.parametrize("count", [1, 2])
def test_a_frame_that_is_no_reply_is_refused_naming_its_ps(count):
    got = replies([(7, 0, 1, 0, 0, 0)] * count)
    got.frames[-1].header[0] = P.PUSH
    with pytest.raises(PeerError, match=f"unexpected message kind {P.PUSH} from a ps"):
        got.finish()
