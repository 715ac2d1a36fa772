"""Fake GPU arrays: the CUDA array interface over host memory, through mpi4py and staging."""

import textwrap

import numpy as np
import pytest

from mpitf.runtime.backend import Backend, describe_backend
from mpitf.testing.fake_gpu import FakeGPUArray, fake_gpu_backend

# Rank 0 sends device arrays to rank 1 (whole, and a slice); then both run the in-graph
# channel's Bcast and Gather on each backend (fake: CUDA-aware and staged; cupy: the real
# one, which stages unless MPI is CUDA-aware). ``kind`` is "fake" or "cupy". Rank 0
# prints "OK 2 ranks" when every check passed on both.
SCRIPT = textwrap.dedent("""
    import sys

    import numpy as np
    from mpi4py import MPI

    from mpitf.runtime.backend import select_backend
    from mpitf.worker.replication import _Channel
    from mpitf.testing.fake_gpu import FakeGPUArray, fake_gpu_backend

    def abort_on_failure(exc_type, exc, tb):  # a failed check must not leave a peer waiting
        sys.__excepthook__(exc_type, exc, tb)
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_on_failure
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    kind = sys.argv[1]
    if kind == "cupy":
        backends = [select_backend("gpu", local_rank=rank)]
    else:
        backends = [fake_gpu_backend(cuda_aware=True), fake_gpu_backend(cuda_aware=False)]

    ref = np.arange(12, dtype=np.float64) * 1.5
    be = backends[0]
    if be.cuda_aware:  # device buffers straight to MPI (a fake one's are host memory)
        if rank == 0:
            comm.Send(be.to_device(ref), dest=1, tag=1)
            whole = be.to_device(ref)
            be.synchronize()
            comm.Send(whole[3:7], dest=1, tag=2)
        elif rank == 1:
            got, part = be.zeros(12, np.float64), be.zeros(4, np.float64)
            be.synchronize()
            comm.Recv(got, source=0, tag=1)
            comm.Recv(part, source=0, tag=2)
            assert np.array_equal(be.to_host(got), ref), be.to_host(got)
            assert np.array_equal(be.to_host(part), ref[3:7]), be.to_host(part)

    for be in backends:
        counted = hasattr(be, "events")
        buf = be.to_device(ref if rank == 0 else np.zeros(12))
        if counted:
            be.events.clear()
        _Channel(comm, be).bcast(buf)
        if counted and rank == 0:
            assert be.events[0] == "synchronize", be.events
            assert ("to_host" in be.events) == (not be.cuda_aware), be.events
        assert np.array_equal(be.to_host(buf), ref)
        n = comm.Get_size()
        mine = be.to_device(np.full(5, rank + 1.0, np.float32))
        rows = be.zeros(n * 5, np.float32).reshape(n, 5) if rank == 0 else None
        if rank == 0:
            rows[0] = mine
        if counted:
            be.events.clear()
        _Channel(comm, be).gather(mine, rows)
        if counted:
            assert be.events[0] == "synchronize", be.events
        if rank == 0:
            want = np.repeat(np.arange(1.0, n + 1), 5).reshape(n, 5)
            assert np.array_equal(be.to_host(rows), want), be.to_host(rows)
    passed = comm.allreduce(1)  # every rank got here: a failed check aborts the world
    if rank == 0:
        print(f"OK {passed} ranks", flush=True)
""")


def _run(mpirun, tmp_path, kind):
    script = tmp_path / "fake_gpu_sendrecv.py"
    script.write_text(SCRIPT)
    run = mpirun(2, script, kind, timeout=60)
    assert not run.timed_out, "mpiexec timed out"
    assert run.returncode == 0, run.output[-3000:]
    assert "OK 2 ranks" in run.stdout, run.output[-3000:]


@pytest.mark.mpi
def test_fake_gpu_send_recv_and_channel(mpirun, tmp_path):
    _run(mpirun, tmp_path, "fake")


@pytest.mark.gpu
@pytest.mark.mpi
def test_cupy_send_recv(mpirun, tmp_path):
    # Raw device sends run only with a CUDA-aware MPI; the channel stages otherwise.
    _run(mpirun, tmp_path, "cupy")


def test_cuda_array_interface_fields():
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    fake = FakeGPUArray(host)
    cai = fake.__cuda_array_interface__
    assert cai["version"] == 3
    assert cai["data"] == (host.__array_interface__["data"][0], False)
    assert cai["typestr"] == "<f4" and cai["shape"] == (4, 6)
    assert cai["strides"] is None and cai["stream"] is None
    column = fake[:, 1]
    assert column.__cuda_array_interface__["strides"] == (24,)
    assert column.__cuda_array_interface__["data"][0] == host[:, 1].__array_interface__[
        "data"][0]
    assert FakeGPUArray(host, readonly=True).__cuda_array_interface__["data"][1] is True
    assert fake.view(np.uint8).__cuda_array_interface__["typestr"] == "|u1"
    assert fake.ptr == cai["data"][0]
    assert not hasattr(fake, "__array_interface__") and not hasattr(fake, "__buffer__")


def test_fake_arrays_behave_like_device_arrays():
    fake = FakeGPUArray.from_host(np.arange(6, dtype=np.float32))
    with pytest.raises(TypeError, match="implicit conversion"):
        np.asarray(fake)
    with pytest.raises(TypeError, match="mixing a host"):
        np.add(fake, np.ones(6, np.float32))
    twice = fake + fake
    assert isinstance(twice, FakeGPUArray)
    np.testing.assert_array_equal(twice.get(), np.arange(6) * 2)
    twice /= 2
    np.testing.assert_array_equal(twice.get(), fake.get())
    view = fake[2:4]
    view[...] = 7  # a view writes through to its base, as on a device
    assert fake.get()[2:4].tolist() == [7, 7]
    out = np.empty(6, np.float32)
    assert fake.get(out=out) is out


def test_fake_backend():
    be = fake_gpu_backend(cuda_aware=False)
    assert isinstance(be, Backend) and be.xp is np and be.is_gpu and not be.cuda_aware
    assert "staging through pinned host buffers" in describe_backend(be)
    assert fake_gpu_backend(True).cuda_aware
    dev = be.zeros(4, np.float32)
    assert isinstance(dev, FakeGPUArray) and be.is_device_array(dev)
    assert not be.is_device_array(np.zeros(4))
    pinned = be.pinned_empty(4, np.float32)
    assert type(pinned) is np.ndarray
    be.to_device(np.arange(4, dtype=np.float32), out=dev)
    assert be.to_host(dev, out=pinned) is pinned
    np.testing.assert_array_equal(pinned, np.arange(4))
    copy = be.to_host(dev)
    copy[0] = 99  # a copy, not the device memory
    assert dev.get()[0] == 0
    be.synchronize()
    be.synchronize()
    assert be.synchronize_calls == 2
    assert be.events == ["to_device", "to_host", "to_host", "synchronize", "synchronize"]
