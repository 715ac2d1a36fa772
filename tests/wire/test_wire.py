"""The wire without MPI: header words by name, and a frame's staging on a fake GPU."""

import numpy as np
import pytest
from mpi4py import MPI

from mpitf.errors import DeadlineError
from mpitf.runtime.backend import numpy_backend
from mpitf.testing.fake_gpu import FakeGPUArray, fake_gpu_backend
from mpitf.wire import header as H
from mpitf.wire import protocol as P
from mpitf.wire.frame import Frame, MPIBuffer


def test_request_header_round_trip_in_place():
    words = np.zeros(H.HEADER_WORDS, np.int64)
    H.pack_push(words, 7, 2, 1000, P.FLAG_CHUNKED, epoch=3, cursor=640)
    got = H.unpack_request(words)
    assert got == H.RequestHeader(P.PUSH, 7, 2, 1000, P.FLAG_CHUNKED, (3 << 40) | 640, 0, 0)
    assert (got.epoch, got.cursor, got.count) == (3, 640, 1000)
    H.pack_push(words, 7, 2, 1000, 0, epoch=2**23 - 1, cursor=2**40 - 1,
                learning_rate=0.125, bucket=3, buckets=5)
    got = H.unpack_request(words)
    assert (got.epoch, got.cursor, H.learning_rate_of(got)) == (2**23 - 1, 2**40 - 1, 0.125)
    assert (got.bucket_index, got.bucket_count) == (3, 5)
    words_only = H.read_words(words)  # the per-step paths' plain tuple, read by index
    assert words_only == tuple(got) and H.learning_rate_of(words_only) == 0.125
    with pytest.raises(ValueError, match="past 2\\*\\*40 examples"):
        H.pack_push(words, 7, 2, 1000, 0, 0, cursor=2**40)


def test_each_request_kind_has_its_writer_and_every_other_word_is_zero():
    words = np.full(H.HEADER_WORDS, -1, np.int64)  # a header left from an earlier request
    H.pack_control(words, P.PULL, 9, 3, P.FLAG_CHUNKED)
    assert H.unpack_request(words) == H.RequestHeader(P.PULL, 9, 3, 0, P.FLAG_CHUNKED, 0, 0, 0)
    H.pack_control(words, P.DONE, 9, 3, P.FLAG_REQUEUE, count=4)  # a leader's positions
    assert H.unpack_request(words) == H.RequestHeader(P.DONE, 9, 3, 4, P.FLAG_REQUEUE, 0, 0, 0)
    H.pack_init(words, 0, 1000, P.FLAG_CHUNKED)
    assert H.unpack_request(words) == H.RequestHeader(P.INIT, 0, 0, 1000, P.FLAG_CHUNKED, 0, 0,
                                                      0)
    H.pack_rates(words, 2, 3)
    assert H.unpack_request(words) == H.RequestHeader(P.RATES, 0, 2, 3, 0, 0, 0, 0)
    H.pack_sparse_pull(words, 5, 1, 70, 0)
    assert H.unpack_request(words) == H.RequestHeader(P.SPARSE_PULL, 5, 1, 70, 0, 0, 0, 0)
    H.pack_sparse_push(words, 5, 1, 70, P.FLAG_CHUNKED)
    assert H.unpack_request(words) == H.RequestHeader(P.SPARSE_PUSH, 5, 1, 70, P.FLAG_CHUNKED,
                                                      0, 0, 0)
    H.pack_push(words, 6, 1, 100, P.FLAG_CHUNKED, 0, 12, learning_rate=0.5)
    H.mark_ward(words)  # re-routed to a lost ps's buddy: the same push, marked
    got = H.unpack_request(words)
    assert got.flags == P.FLAG_CHUNKED | P.FLAG_LEARNING_RATE | P.FLAG_WARD
    assert (got.kind, got.step, got.count, got.cursor, H.learning_rate_of(got)) == \
        (P.PUSH, 6, 100, 12, 0.5)
    H.pack_request(words, P.SKIP, 4, 2)  # any kind, for tools and tests
    assert H.unpack_request(words) == H.RequestHeader(P.SKIP, 4, 2, 0, 0, 0, 0, 0)


def test_reply_header_names_every_counter():
    words = np.zeros(H.HEADER_WORDS, np.int64)
    H.pack_reply(words, 12, 1, P.FLAG_PAUSE, pushes_applied=30, stale_dropped=4,
                 max_staleness=5, max_lead=2)
    got = H.unpack_reply(words)
    assert got.kind == P.REPLY and got.step == 12 and got.ps == 1
    assert (got.pushes_applied, got.stale_dropped) == (30, 4)
    assert (got.max_staleness, got.max_lead) == (5, 2)
    assert got.flags & P.FLAG_PAUSE


@pytest.mark.parametrize("aware", [True, False])
def test_frame_on_a_fake_gpu(aware):
    be = fake_gpu_backend(cuda_aware=aware)
    frame = Frame.allocate(be, 5, np.float32)
    assert isinstance(frame.payload, FakeGPUArray) and frame.staged == (not aware)
    assert frame.bytes.nbytes == H.HEADER_BYTES + 5 * 4
    assert isinstance(frame.bytes, FakeGPUArray) == aware  # what MPI is handed
    be.to_device(np.arange(5, dtype=np.float32), out=frame.payload)
    H.pack_push(frame.header, 1, 0, 5, 0, 0, 0)
    frame.publish()
    raw = frame.bytes.get() if aware else frame.bytes
    sent = raw[:H.HEADER_BYTES].view(np.int64).copy()
    assert H.unpack_request(sent).count == 5
    assert raw[H.HEADER_BYTES:].view(np.float32).tolist() == [0, 1, 2, 3, 4]
    # What MPI writes is read back: the header once, the payload onto the device.
    incoming = np.zeros_like(raw)
    incoming[:H.HEADER_BYTES].view(np.int64)[:] = sent
    incoming[H.HEADER_BYTES:].view(np.float32)[:] = 9
    if aware:
        frame.bytes.set(incoming)
        frame.header[:] = 0  # a host copy: the header arrives on the device
    else:
        frame.bytes[:] = incoming  # the pinned mirror, header included
    assert H.unpack_request(frame.fetch_header()).kind == P.PUSH
    frame.received()
    assert be.to_host(frame.payload).tolist() == [9] * 5


def test_mpi_buffer_is_the_array_where_mpi_reads_it():
    host = np.zeros(4)
    assert MPIBuffer(numpy_backend(), host).mpi is host
    be = fake_gpu_backend(cuda_aware=False)
    dev = be.zeros(6, np.float64).reshape(2, 3)
    buf = MPIBuffer(be, dev)
    assert type(buf.mpi) is np.ndarray and buf.mpi.shape == (2, 3)
    be.to_device(np.ones((2, 3)), out=dev)
    buf.to_mpi(1)
    assert buf.mpi[1].tolist() == [1, 1, 1]
    buf.mpi[...] = 5
    buf.from_mpi()
    assert be.to_host(dev).tolist() == [[5, 5, 5], [5, 5, 5]]


def test_a_deadline_names_the_request_still_pending_among_finished_persistent_ones():
    """A finished persistent request is not null; the error names the one still waiting."""
    comm = MPI.COMM_SELF
    sent, got, never = (np.zeros(4, np.uint8) for _ in range(3))
    send = comm.Send_init([sent, MPI.BYTE], 0, 1)
    done = comm.Recv_init([got, MPI.BYTE], 0, 1)
    pending = comm.Recv_init([never, MPI.BYTE], 0, 2)  # nothing is sent on tag 2
    MPI.Prequest.Startall([done, send, pending])
    with pytest.raises(DeadlineError, match="task:1"):
        P.wait_all([done, pending, send], 0.05,
                   lambda i: dict(rank=0, job="ps", task=i))
    pending.Cancel()
    pending.Wait()
    for request in (send, done, pending):
        request.Free()
