"""The 64-byte frame header: eight int64 words, named per kind, packed and read here only.

A request (worker -> ps) and a reply (ps -> worker) share the words that route a message
(kind, step, sender, flags) and name the others for what they carry:

====  ===========================================  =========================================
word  request (push, pull, init, done, ...)        reply
====  ===========================================  =========================================
0     kind                                         kind (``REPLY``)
1     step: the ps's step the gradient was         step: the ps's global step
      computed on
2     worker: the sending worker task              ps: the answering ps task
3     count: payload elements (0: header only;     pushes_applied: gradients applied so far
      sparse kinds: ids in all tables; paused
      and done from a node's leader: its
      replicas, one data position word each;
      rates: optimizer groups, one float64
      learning rate each)
4     flags (``FLAG_CHUNKED``, ``FLAG_REQUEUE``)   flags (``FLAG_PAUSE``; above bit 32,
                                                   the chief after a lost one)
5     position: the worker's data position after   stale_dropped: stale gradients dropped
      this batch (push): epoch << 40 | cursor
      within the epoch
6     learning_rate: the float64 bits of the rate  max_staleness: largest staleness seen
      to apply (push with ``FLAG_LEARNING_RATE``;
      else 0)
7     bucket (push): index << 32 | count of the    max_lead: largest lead over the slowest
      buckets of this push, in push order (0: the  worker (``ssp``; 0 in other modes);
      whole frame, one bucket)                     with ``FLAG_CLIPPED`` (sync): the float64
                                                   bits of the clipped step's gradient norm
====  ===========================================  =========================================

A sparse reply (``SPARSE_REPLY``, the rows a sparse pull asked for) has the reply's words.
A reply has no element count: its payload is the shard, whose size both sides know from
the layout, and the word carries a counter instead, so every counter travels under its
own name in every mode. Each request kind has one writer here (:func:`pack_push`,
:func:`pack_control`, :func:`pack_init`, :func:`pack_rates`, :func:`pack_sparse_pull`,
:func:`pack_sparse_push`; :func:`mark_ward` re-marks one re-routed), and nothing else
writes a word. Packing writes eight ints into a preallocated header (no allocation, one
``struct`` call); reading unpacks the words once into a small named tuple.
"""

import struct
from typing import NamedTuple

from . import protocol as P

HEADER_WORDS = 8
_CURSOR_BITS = 40  # a request's data position: epoch << 40 | cursor, one word
_CURSOR_MASK = (1 << _CURSOR_BITS) - 1
HEADER_BYTES = HEADER_WORDS * 8


class RequestHeader(NamedTuple):
    """The header of a worker's request, word by word."""

    kind: int
    step: int
    worker: int
    count: int
    flags: int
    position: int  # epoch << 40 | cursor: read as .epoch and .cursor
    learning_rate: int  # float64 bits; read with :func:`learning_rate_of`
    bucket: int

    @property
    def epoch(self):
        """Return the worker's epoch after this batch (push)."""
        return self.position >> _CURSOR_BITS

    @property
    def cursor(self):
        """Return the worker's position within that epoch (push)."""
        return self.position & _CURSOR_MASK

    @property
    def bucket_index(self):
        """Return this push's bucket, in push order (0 for a whole frame)."""
        return self.bucket >> 32

    @property
    def bucket_count(self):
        """Return how many buckets the push has (1 for a whole frame)."""
        return (self.bucket & 0xFFFFFFFF) or 1


class ReplyHeader(NamedTuple):
    """The header of a ps's reply, word by word."""

    kind: int
    step: int
    ps: int
    pushes_applied: int
    flags: int
    stale_dropped: int
    max_staleness: int
    max_lead: int


_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")
# The eight words at once, in the int64 array's own (native) order: one call packs or reads
# a header, where eight numpy item accesses cost several times as much (4 KiB round trips).
_WORDS = struct.Struct(f"={HEADER_WORDS}q")


def pack_request(words, kind, step, worker, count=0, flags=0, epoch=0, cursor=0,
                 learning_rate=None, bucket=0, buckets=0):
    """Write a request header of any ``kind``, every word named, into ``words`` (in place).

    For tools and tests that make requests of any kind; the worker writes each kind with
    its own writer below (the words as :func:`pack_push` describes them).
    """
    pack_push(words, step, worker, count, flags, epoch, cursor, learning_rate, bucket, buckets)
    words[0] = kind


# -- one writer per request kind: what the worker sends --------------------------------------

def pack_push(words, step, worker, count, flags, epoch, cursor, learning_rate=None, bucket=0,
              buckets=0):
    """Write a ``PUSH`` header: ``count`` gradient elements computed on ps step ``step``.

    ``(epoch, cursor)`` is the worker's data position after this batch; a ``learning_rate``
    (a float, or None: the ps's own) travels as its float64 bits with
    ``FLAG_LEARNING_RATE``; ``bucket`` of ``buckets`` names a bucketed push's part
    (``buckets`` 0: the whole frame). One ``struct`` call: this runs every step.
    """
    if cursor >> _CURSOR_BITS:
        raise ValueError(f"data cursor {cursor} is past 2**{_CURSOR_BITS} examples per epoch")
    rate = 0
    if learning_rate is not None:
        flags |= P.FLAG_LEARNING_RATE
        rate = _I64.unpack(_F64.pack(learning_rate))[0]
    _WORDS.pack_into(words, 0, P.PUSH, step, worker, count, flags,
                     (epoch << _CURSOR_BITS) | cursor, rate, (bucket << 32) | buckets)


def pack_control(words, kind, step, worker, flags, count=0):
    """Write the header of a request ``kind`` that carries no gradient.

    The kinds: a pull (of the parameters or of their average), skip, paused, done, save
    and counters. ``count``: int64 words after the header (paused and done from a node's
    leader: one data position per replica of the node); 0: the header alone.
    """
    _WORDS.pack_into(words, 0, kind, step, worker, count, flags, 0, 0, 0)


def pack_init(words, worker, count, flags):
    """Write an ``INIT`` header: ``count`` initial parameter elements (the chief's)."""
    _WORDS.pack_into(words, 0, P.INIT, 0, worker, count, flags, 0, 0, 0)


def pack_rates(words, worker, count):
    """Write a ``RATES`` header: ``count`` optimizer groups' float64 learning rates follow."""
    _WORDS.pack_into(words, 0, P.RATES, 0, worker, count, 0, 0, 0, 0)


def pack_sparse_pull(words, step, worker, count, flags):
    """Write a ``SPARSE_PULL`` header: ``count`` ids in all tables, whose rows come back."""
    _WORDS.pack_into(words, 0, P.SPARSE_PULL, step, worker, count, flags, 0, 0, 0)


def pack_sparse_push(words, step, worker, count, flags):
    """Write a ``SPARSE_PUSH`` header: ``count`` ids in all tables, each with its row gradient."""
    _WORDS.pack_into(words, 0, P.SPARSE_PUSH, step, worker, count, flags, 0, 0, 0)


def mark_ward(words):
    """Mark the request in ``words`` for a lost ps's shard (``FLAG_WARD``), in place.

    A request re-routed to the buddy of a lost ps (worker/link.py) leaves again as it was,
    with this flag added to its flags word.
    """
    words[4] |= P.FLAG_WARD  # the flags word


def pack_reply(words, step, ps, flags, pushes_applied, stale_dropped, max_staleness, max_lead,
               kind=P.REPLY, norm=None):
    """Write a reply header (``REPLY`` or ``SPARSE_REPLY``) into ``words`` (in place).

    ``norm``: the gradient norm of the last step the ps clipped (sync mode), which then
    takes ``max_lead``'s word as its float64 bits, with ``FLAG_CLIPPED``.
    """
    if norm is not None:
        flags |= P.FLAG_CLIPPED
        max_lead = _I64.unpack(_F64.pack(norm))[0]
    _WORDS.pack_into(words, 0, kind, step, ps, pushes_applied, flags, stale_dropped,
                     max_staleness, max_lead)


def norm_of(word):
    """Return the gradient norm a ``FLAG_CLIPPED`` reply's last word holds."""
    return _F64.unpack(_I64.pack(word))[0]


# tuple.__new__ straight from the words: _make's length check costs more than the rest
# (the arrays are HEADER_WORDS long by construction).
_new = tuple.__new__


# The eight words as a plain tuple, without names: for the per-step paths that index them.
read_words = _WORDS.unpack_from


def unpack_request(words):
    """Return the :class:`RequestHeader` in the int64 array ``words``."""
    return _new(RequestHeader, _WORDS.unpack_from(words))


def learning_rate_of(request):
    """Return the learning rate a request's words carry, or None if they have none.

    ``request``: a :class:`RequestHeader` or the plain words of :func:`read_words`.
    """
    if not request[4] & P.FLAG_LEARNING_RATE:  # flags
        return None
    return _F64.unpack(_I64.pack(request[6]))[0]  # the rate's float64 bits


def split_position(word):
    """Return (epoch, cursor) of a data position word (``epoch << 40 | cursor``)."""
    return word >> _CURSOR_BITS, word & _CURSOR_MASK


def unpack_reply(words):
    """Return the :class:`ReplyHeader` in the int64 array ``words``."""
    return _new(ReplyHeader, _WORDS.unpack_from(words))
