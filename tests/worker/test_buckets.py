"""Buckets end to end: the same numbers as one frame per ps, in every mode, under mpiexec.

A push leaves per ps in buckets (``--bucket-bytes``), last layers first; the ps applies each
on its slice as it lands. Sync, async and ssp with buckets must equal the one-frame run
bit for bit (the optimizers work element by element, and sync sums per bucket in the same
order); backup workers, embedding tables and a restored checkpoint keep working.
"""

import json
import re

import numpy as np
import pytest

from mpitf.cluster import ClusterSpec
from mpitf.config import (
    DEFAULT_BUCKET_BYTES,
    LINK_BUCKET_BYTES,
    TrainingConfig,
    shard_bucket_bytes,
)
from mpitf.errors import ConfigurationError
from mpitf.models import build_model
from mpitf.placement import replica_device_setter
from mpitf.testing import run_mpi
from mpitf.wire import header as H
from mpitf.wire.layout import FlatLayout, bucket_ranges
from mpitf.worker.buckets import buckets_for_links
from tests.support import REPO

JOB = "jobs/mnist_mlp.py"
FINAL = re.compile(r"^final: (\{.*\})$", re.MULTILINE)


def _placement(num_ps):
    spec = ClusterSpec({"ps": [f"h:{i}" for i in range(num_ps)], "worker": ["h:9"]})
    return replica_device_setter(spec).place(build_model("mlp", 64, 10).variables())


def test_buckets_are_cut_between_modules_and_pushed_last_layers_first():
    placement = _placement(1)  # one ps: hidden1/weights, biases, softmax weights, biases
    slices = placement.slices_for_ps(0)
    size = placement.shard_sizes[0]
    assert [(s.offset, s.size) for s in slices] == [(0, 8192), (8192, 128), (8320, 1280),
                                                    (9600, 10)]
    assert bucket_ranges(slices, size, 0, 4) == [(0, size)]
    assert bucket_ranges(slices, size, size * 4, 4) == [(0, size)]  # huge: one bucket
    # 33 KiB: softmax_linear (5,160 bytes) fills the first bucket; hidden1 (33,280 bytes)
    # would take it over, so it is the last one pushed, weights and biases together
    assert bucket_ranges(slices, size, 33 * 1024, 4) == [(8320, 9610), (0, 8320)]
    # 6 KiB: hidden1 is larger than a bucket, so it is cut between its variables into
    # buckets of its own (its biases do not wait in softmax_linear's bucket for it), and
    # its weights (32 KiB) into six equal pieces, pushed from their end
    ranges = bucket_ranges(slices, size, 6 * 1024, 4)
    assert ranges == [(8320, 9610), (8192, 8320), (6827, 8192), (5462, 6827), (4096, 5462),
                      (2731, 4096), (1366, 2731), (0, 1366)]
    assert all((hi - lo) * 4 <= 6 * 1024 for lo, hi in ranges[2:])
    # every bucket a frame with its own header slot, in memory from the shard's start
    layout = FlatLayout(placement, [ranges])
    hdr = H.HEADER_BYTES // 4
    bounds = sorted(lo for lo, _ in ranges) + [size]
    assert [seg for _, _, seg in layout.frames] == [
        (i * hdr + lo, (i + 1) * hdr + lo, (i + 1) * hdr + hi)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    flat = np.zeros(layout.size, dtype=np.float32)
    views = layout.views(flat)
    # a variable within a bucket is a view; one cut between buckets an array of its own,
    # scattered piece by piece around the header slots
    assert [name for name, _ in views.split] == ["hidden1/weights"]
    views.arrays["softmax_linear/biases"][...] = 7
    assert np.all(flat[8 * hdr + 9600:8 * hdr + 9610] == 7)
    views.arrays["hidden1/weights"].reshape(-1)[...] = np.arange(8192)
    views.scatter()
    for i, (lo, hi) in enumerate(zip(bounds[:6], bounds[1:7])):
        assert np.array_equal(flat[(i + 1) * hdr + lo:(i + 1) * hdr + hi], np.arange(lo, hi))
    assert np.all(flat[:hdr] == 0) and np.all(flat[hdr + 1366:2 * hdr + 1366] == 0)
    assert layout.num_elements == size


def _torch_mlp_slices():
    """A torch MLP 784-512-512-10's parameters on one ps, as torch names them."""
    spec = ClusterSpec({"ps": ["h:0"], "worker": ["h:9"]})
    variables = [("0.weight", (512, 784)), ("0.bias", (512,)), ("2.weight", (512, 512)),
                 ("2.bias", (512,)), ("4.weight", (10, 512)), ("4.bias", (10,))]
    placement = replica_device_setter(spec).place([(n, s, "float32") for n, s in variables])
    return placement.slices_for_ps(0), placement.shard_sizes[0]


def test_a_layer_leaves_with_its_bias_and_the_last_bucket_is_the_first_layer():
    slices, size = _torch_mlp_slices()
    first = 784 * 512 + 512  # the first layer: 1.6 MB, larger than a bucket would share
    # 2 MiB: the last two layers (1.07 MB) leave as soon as backward has the second
    # layer's gradients; the first layer, weight and bias, is the last bucket
    assert bucket_ranges(slices, size, DEFAULT_BUCKET_BYTES, 4) == [(first, size), (0, first)]
    # 1 MiB: the second layer (1.05 MB) is larger than a bucket: cut between its weight
    # (1 MiB, a bucket of its own) and bias, the third layer's not waiting for it; the
    # first layer's weight (1.53 MiB) in two halves
    second = first + 512 * 512
    half = 784 * 512 // 2
    assert bucket_ranges(slices, size, 1 << 20, 4) == [
        (second + 512, size), (second, second + 512), (first, second),
        (784 * 512, first), (half, 784 * 512), (0, half)]


def test_the_bucket_word_travels_in_the_request_header():
    words = np.zeros(H.HEADER_WORDS, np.int64)
    H.pack_push(words, 7, 2, 100, 0, 0, 0, bucket=3, buckets=5)
    request = H.unpack_request(words)
    assert (request.bucket_index, request.bucket_count, request.step) == (3, 5, 7)
    H.pack_push(words, 7, 2, 100, 0, 0, 0)
    assert (H.unpack_request(words).bucket_index, H.unpack_request(words).bucket_count) == (0, 1)


@pytest.mark.parametrize("value", [-1, 1.5, "64"])
def test_bad_bucket_bytes_are_refused(value):
    with pytest.raises(ConfigurationError, match="bucket_bytes"):
        TrainingConfig(bucket_bytes=value)


class _Hosts:
    """The two things buckets_for_links reads of a Server: its ranks' jobs and hosts."""

    def __init__(self, ps_hosts, worker_hosts):
        self.hosts = ps_hosts + worker_hosts
        self.replica_ranks = list(range(len(ps_hosts), len(self.hosts)))
        self._ps = list(range(len(ps_hosts)))

    def ranks_of(self, job):
        return self._ps if job == "ps" else []

    def host_of(self, rank):
        return self.hosts[rank]


@pytest.mark.parametrize("ps_hosts,worker_hosts,given,expected", [
    (["a"], ["a", "a"], None, DEFAULT_BUCKET_BYTES),       # one node: shared memory
    (["a"], ["a", "b"], None, LINK_BUCKET_BYTES),          # a worker on another node
    (["a", "b"], ["a"], None, LINK_BUCKET_BYTES),          # a ps on another node
    (["a"], ["b"], 4 << 20, 4 << 20),                      # --bucket-bytes given: kept
    (["a"], ["b"], 0, 0),                                  # one frame asked for: kept
])
def test_the_default_bucket_size_follows_the_nodes(ps_hosts, worker_hosts, given, expected):
    config = buckets_for_links(TrainingConfig(bucket_bytes=given), _Hosts(ps_hosts, worker_hosts))
    assert config.bucket_bytes == expected
    # still a default: an option that needs one frame resolves it to 0 again
    if given is None:
        assert config.replace(aggregate_per_node=True).bucket_bytes == 0


@pytest.mark.parametrize("shard_bytes,across,given,expected", [
    (16 << 20, True, None, LINK_BUCKET_BYTES),   # 128 buckets of 128 KiB already
    (8 << 20, True, None, 128 << 10),            # 2 ps of a 16 MiB model: 64 of 128 KiB
    (4 << 20, True, None, 64 << 10),             # 4 ps of a 16 MiB model: 64 of 64 KiB
    (2 << 20, True, None, 32 << 10),             # 8 ps of a 16 MiB model: 64 of 32 KiB
    (512 << 10, True, None, 32 << 10),           # never below 32 KiB
    (512 << 10, True, 128 << 10, 128 << 10),     # --bucket-bytes given: kept
    (512 << 10, False, None, DEFAULT_BUCKET_BYTES),  # one node: shared memory, no rounds
])
def test_a_small_shard_across_nodes_travels_in_smaller_buckets(shard_bytes, across, given,
                                                                expected):
    config = TrainingConfig(bucket_bytes=given, across_nodes=across)
    assert shard_bucket_bytes(config, shard_bytes) == expected


def _train(tmp_path, n, mode, buckets, *extra, name=None, timeout=90):
    out = tmp_path / f"{name or mode}-{buckets}.npz"
    run = run_mpi(n, [JOB, "--data", str(_train.data), "--num-ps", "2", "--steps", "12",
                      "--mode", mode, "--optimizer", "adam", "--lr", "0.01", "--seed", "3",
                      "--batch-size", "16", "--bucket-bytes", str(buckets), "--export",
                      str(out), *map(str, extra)], timeout=timeout, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    summary = json.loads(FINAL.findall(run.stdout)[-1])
    with np.load(out) as f:
        return summary, {k: f[k] for k in f.files}


@pytest.fixture(autouse=True)
def _data(digits_file):
    _train.data = digits_file


def _assert_same_bits(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), (
            f"{k} differs by {np.abs(got[k] - want[k]).max()}")


@pytest.mark.mpi
@pytest.mark.parametrize("mode,n,extra", [
    ("sync", 4, ["--deterministic", "--moving-average-decay", "0.9"]),
    # two workers: a + b == b + a, so plain sync is bitwise too (slow tier: 2.5 s)
    pytest.param("sync", 4, [], marks=pytest.mark.slow),
    ("async", 3, []),
    pytest.param("ssp", 3, ["--staleness", "1"], marks=pytest.mark.slow),  # async's path
])
def test_buckets_equal_one_frame_bit_for_bit(tmp_path, mode, n, extra):
    # 2 ps; 64-byte buckets cut each shard in two; n - 2 workers (one in async and ssp,
    # where more would make the order of updates timing's)
    one, want = _train(tmp_path, n, mode, 0, *extra)
    many, got = _train(tmp_path, n, mode, 64, *extra)
    assert one["step"] == many["step"] == 12
    assert one["stale_dropped"] == many["stale_dropped"] == 0
    _assert_same_bits(got, want)
    assert many["test_accuracy"] == one["test_accuracy"]


@pytest.mark.mpi
def test_backup_workers_with_buckets(tmp_path):
    # 3 workers, 2 aggregated per bucket: the slowest's buckets are dropped or used
    summary, params = _train(tmp_path, 5, "sync", 64, "--replicas-to-aggregate", "2",
                             name="backup")
    assert summary["step"] == 12
    assert summary["workers"] == 3
    assert all(np.isfinite(v).all() for v in params.values())
    assert summary["test_accuracy"] > 0.5, summary


@pytest.mark.slow
@pytest.mark.mpi
def test_embedding_tables_train_alongside_buckets(tmp_path):
    from mpitf.data.ctr import synthetic_ctr

    data = str(tmp_path / "ctr.h5")
    synthetic_ctr(data, train=2000, test=500, fields=3, rows=40, dense=2, seed=4)
    finals = []
    for buckets in (0, 64):
        run = run_mpi(4, ["-m", "mpitf.jobs.ctr", "--data", data, "--num-ps", "2", "--steps",
                          "40", "--batch-size", "32", "--optimizer", "adagrad", "--lr", "0.1",
                          "--mode", "sync", "--deterministic", "--eval-every", "0",
                          "--bucket-bytes", str(buckets)], timeout=90, cwd=str(REPO))
        assert not run.timed_out and run.returncode == 0, run.output
        finals.append(json.loads(FINAL.findall(run.stdout)[-1]))
    one, many = finals
    assert one["step"] == many["step"] == 40
    # the tables' rows and the dense buckets: the same numbers as one frame
    assert (many["test_auc"], many["test_logloss"]) == (one["test_auc"], one["test_logloss"])
    assert one["test_auc"] > 0.55, one


def test_a_progress_thread_drives_buckets_to_a_ps_on_another_node_only():
    from types import SimpleNamespace

    from mpitf.worker.buckets import REMOTE_PROGRESS_US, progress_seconds

    hosts = {0: "n1", 1: "n1", 2: "n2"}
    comm = SimpleNamespace(Get_rank=lambda: 1)
    link = SimpleNamespace(comm=comm, ranks=[0], host_of=hosts.get)
    assert progress_seconds(link, {}) == 0.0  # the ps shares this node
    link.ranks = [0, 2]
    assert progress_seconds(link, {}) == REMOTE_PROGRESS_US / 1e6  # one ps is remote
    assert progress_seconds(link, {"MPITF_PROGRESS_US": "0"}) == 0.0
    link.ranks = [0]
    assert progress_seconds(link, {"MPITF_PROGRESS_US": "100"}) == 100e-6
    assert progress_seconds(link, {"MPITF_PROGRESS_US": ""}) == 0.0  # empty: unset
    with pytest.raises(ConfigurationError, match="MPITF_PROGRESS_US='fast' is not a number"):
        progress_seconds(link, {"MPITF_PROGRESS_US": "fast"})
