"""Device-buffer paths on CPU: fake GPU arrays sent as they are, or staged in chunks.

Every rank (ps and workers) runs on a fake GPU backend whose arrays expose
``__cuda_array_interface__`` over host memory; the parameters after a few deterministic
sync steps must equal, bit for bit, those of the same run on numpy.
"""

import json
import re

import numpy as np
import pytest

from mpitf.errors import ConfigurationError
from mpitf.testing import run_mpi
from mpitf.wire.frame import chunk_ranges, chunk_tag
from mpitf.wire.protocol import CHUNK_TAG_OFFSET, TAG_REPLY
from tests.support import REPO

DRIVER = str(REPO / "tests" / "mpi" / "staging_driver.py")


def test_chunk_ranges_cover_the_frame_in_order():
    assert chunk_ranges(100, None) == [(0, 100)]
    assert chunk_ranges(100, 128) == [(0, 100)]
    ranges = chunk_ranges(1000, 256)
    assert ranges == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert chunk_tag(TAG_REPLY, 0) == TAG_REPLY
    assert chunk_tag(TAG_REPLY, 3) == TAG_REPLY + CHUNK_TAG_OFFSET


def _run(kind, out, chunk=1024, buckets=0):
    res = run_mpi(4, [DRIVER, kind, str(out), str(chunk), str(buckets)], timeout=90,
                  cwd=str(REPO))
    assert res.returncode == 0 and not res.timed_out, res.output
    steps = json.loads(re.search(r"^steps (.*)$", res.stdout, re.M).group(1))
    assert steps == [1, 2, 3, 4, 5], res.output
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("staging") / "numpy.npz"
    _run("numpy", out)
    return np.load(out)


@pytest.mark.mpi
@pytest.mark.parametrize("kind,chunk", [("fake-aware", 1024), ("fake-staged", 1024),
                                        ("fake-staged", 64), ("fake-staged", 1 << 20)])
def test_device_paths_give_the_numpy_bits(reference, tmp_path, kind, chunk):
    out = tmp_path / f"{kind}.npz"
    res = _run(kind, out, chunk)
    got = np.load(out)
    assert sorted(got.files) == sorted(reference.files)
    for name in reference.files:
        assert np.array_equal(got[name], reference[name]), name
    events = json.loads(re.search(r"^events (\[.*\])", res.stdout, re.M).group(1))
    syncs = int(re.search(r"synchronize_calls (\d+)", res.stdout).group(1))
    assert syncs >= 5  # the stream is synchronised before every push hands buffers to MPI
    if kind == "fake-staged":
        # Staged: device data went through host buffers with the async copies, both ways.
        assert "to_host_async" in events and "to_device_async" in events, events
    else:
        # CUDA-aware: the device buffers went to MPI as they are, no staging copies.
        assert "to_host_async" not in events and "to_device_async" not in events, events


@pytest.mark.mpi
@pytest.mark.parametrize("kind,chunk", [("numpy", 1024), ("fake-aware", 1024),
                                        ("fake-staged", 64), ("fake-staged", 1 << 20)])
def test_buckets_on_device_paths_give_the_one_frame_bits(reference, tmp_path, kind, chunk):
    # 256-byte buckets: every ps's shard in several frames, variables larger than a bucket
    # cut into pieces (their gradients scattered into them), a partitioned variable included
    out = tmp_path / f"{kind}-buckets.npz"
    res = _run(kind, out, chunk, buckets=256)
    assert json.loads(re.search(r"^buckets (.*)$", res.stdout, re.M).group(1)) == [11, 12], \
        res.output
    got = np.load(out)
    for name in reference.files:
        assert np.array_equal(got[name], reference[name]), name


@pytest.mark.mpi
@pytest.mark.gpu
def test_real_gpu_gives_the_numpy_bits(reference, tmp_path):
    out = tmp_path / "gpu.npz"
    _run("gpu", out)
    got = np.load(out)
    for name in reference.files:
        # Device kernels may round differently from numpy's: close, not bit-equal.
        np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-6)


def test_chunk_size_must_fit_the_header(tmp_path):
    from mpitf.worker.client import Client

    class _Server:  # only what Client reads before it checks chunk_bytes
        comm = None
        replica_index = 0

        @staticmethod
        def ranks_of(job):
            return [0]

    from mpitf.placement import Placement

    with pytest.raises(ConfigurationError, match="multiple of 64"):
        Client(_Server(), Placement([("w", (4,), "f4")], 1), chunk_bytes=100)
