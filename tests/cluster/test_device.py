import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpitf.cluster.device import (
    DeviceSpec,
    device_name,
    gpu_for_local_rank,
    local_rank,
    visible_gpus,
)
from mpitf.errors import ConfigurationError


@pytest.mark.parametrize("text,fields,printed", [
    ("/job:ps/task:1", ("ps", None, 1, None, None), "/job:ps/task:1"),
    ("/job:worker/replica:0/task:2/device:GPU:0", ("worker", 0, 2, "GPU", 0),
     "/job:worker/replica:0/task:2/device:GPU:0"),
    ("/replica:2/job:ps", ("ps", 2, None, None, None), "/job:ps/replica:2"),
    ("/gpu:0", (None, None, None, "GPU", 0), "/device:GPU:0"),
    ("/cpu:1", (None, None, None, "CPU", 1), "/device:CPU:1"),
    ("/device:CPU:*", (None, None, None, "CPU", None), "/device:CPU:*"),
    ("GPU:0", (None, None, None, "GPU", 0), "/device:GPU:0"),
    ("/GPU", (None, None, None, "GPU", None), "/device:GPU:*"),
    ("/device:gpu:3", (None, None, None, "GPU", 3), "/device:GPU:3"),
    ("/device:XLA_GPU:1", (None, None, None, "XLA_GPU", 1), "/device:XLA_GPU:1"),
    ("/task:3/device:CPU:0/job:w", ("w", None, 3, "CPU", 0), "/job:w/task:3/device:CPU:0"),
    ("/job:a/job:b", ("b", None, None, None, None), "/job:b"),
    ("", (None,) * 5, ""),
    ("//job:ps//", ("ps", None, None, None, None), "/job:ps"),
])
def test_parse_and_print(text, fields, printed):
    spec = DeviceSpec.from_string(text)
    assert (spec.job, spec.replica, spec.task, spec.device_type, spec.device_index) == fields
    assert spec.to_string() == printed
    assert str(spec) == printed


@pytest.mark.parametrize("text,token", [
    ("/job:ps/tusk:1", "unknown component 'tusk:1'"),
    ("/job:ps/task:x", "bad index 'x' in 'task:x'"),
    ("/task:-1", "bad index '-1'"),
    ("/device:GPU:a", "bad index 'a' in 'device:GPU:a'"),
    ("/gpu:0/cpu:0", "second device 'cpu:0'"),
    ("/device:GPU", "unknown component 'device:GPU'"),
    ("/job:", "bad job ''"),
    ("/job:ps:1", "unknown component 'job:ps:1'"),
    ("/device::0", "bad device type ''"),
])
def test_bad_strings_name_the_component(text, token):
    with pytest.raises(ConfigurationError, match=token):
        DeviceSpec.from_string(text)
    with pytest.raises(ValueError):
        DeviceSpec.from_string(text)


def test_constructor():
    spec = DeviceSpec(job="ps", replica="0", task=1, device_type="gpu", device_index=0)
    assert spec.to_string() == "/job:ps/replica:0/task:1/device:GPU:0"
    assert DeviceSpec().to_string() == ""
    assert DeviceSpec(device_type="tpu").device_type == "tpu"  # TF upper-cases only cpu/gpu
    for kwargs, token in [({"task": -1}, "bad task -1"), ({"job": "a/b"}, "bad job 'a/b'"),
                          ({"device_index": 1.5}, "bad device index 1.5"),
                          ({"replica": True}, "bad replica True")]:
        with pytest.raises(ConfigurationError, match=token):
            DeviceSpec(**kwargs)
    with pytest.raises(AttributeError):
        spec.job = "worker"


def test_merge_and_replace():
    base = DeviceSpec(job="ps", device_type="CPU")
    merged = base.make_merged_spec(DeviceSpec(device_type="GPU", device_index=1))
    assert merged == DeviceSpec(job="ps", device_type="GPU", device_index=1)
    assert base == DeviceSpec(job="ps", device_type="CPU")  # unchanged
    assert base.make_merged_spec(DeviceSpec()) == base
    assert base.replace(job=None, task=2).to_string() == "/task:2/device:CPU:*"
    with pytest.raises(ConfigurationError, match="unknown field 'device'"):
        base.replace(device="GPU")


def test_equality_hash_repr():
    a = DeviceSpec.from_string("/gpu:0/job:ps")
    b = DeviceSpec(job="ps", device_type="GPU", device_index=0)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != DeviceSpec(job="ps") and a != "/job:ps/device:GPU:0"
    assert eval(repr(a), {"DeviceSpec": DeviceSpec}) == a


def test_device_name():
    assert device_name("ps", 1) == "/job:ps/replica:0/task:1/device:CPU:0"
    assert device_name("worker", 0, "gpu", 3) == "/job:worker/replica:0/task:0/device:GPU:3"


name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_*-]{0,8}", fullmatch=True)
index = st.none() | st.integers(0, 10**6)


@given(st.builds(DeviceSpec, job=st.none() | name, replica=index, task=index,
                 device_type=st.none() | name, device_index=index))
def test_string_round_trip(spec):
    assert DeviceSpec.from_string(spec.to_string()) == spec


# --- local placement -----------------------------------------------------------------
def test_local_rank_single_process():
    from mpi4py import MPI

    assert local_rank(MPI.COMM_SELF) == (0, 1)
    if MPI.COMM_WORLD.Get_size() == 1:
        assert local_rank(MPI.COMM_WORLD) == (0, 1)


@pytest.mark.parametrize("value,count,expected", [
    ("2,3", None, [2, 3]),
    (" 1 , 0 ", None, [1, 0]),
    ("", None, []),
    ("-1", 4, []),
    ("NoDevFiles", None, []),
    ("0,1,-1,2", None, [0, 1]),
    ("0,0,1", None, [0]),
    ("0,5,1", 4, [0]),
    ("GPU-8f1c,MIG-2a", None, ["GPU-8f1c", "MIG-2a"]),
])
def test_visible_gpus(value, count, expected):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}, device_count=count) == expected


def test_visible_gpus_without_variable(caplog):
    assert visible_gpus({}) == []
    assert visible_gpus({}, device_count=3) == [0, 1, 2]
    with caplog.at_level(logging.WARNING, logger="mpitf"):
        assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,x,1"}) == [0]
    assert "'x'" in caplog.text
    with pytest.raises(ConfigurationError, match="bad device_count -1"):
        visible_gpus({}, device_count=-1)


def test_gpu_for_local_rank():
    assert [gpu_for_local_rank(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert gpu_for_local_rank(3, 0) is None
    with pytest.raises(ConfigurationError, match="bad local_rank -1"):
        gpu_for_local_rank(-1, 2)


def test_parse_from_string_returns_a_new_spec():
    cpu = DeviceSpec.from_string("/job:ps/task:1/cpu:0")
    gpu = cpu.parse_from_string("/gpu:1")
    assert gpu == DeviceSpec(device_type="GPU", device_index=1)  # TF 2: no fields of cpu
    assert cpu.to_string() == "/job:ps/task:1/device:CPU:0"  # unchanged: specs are immutable
    with pytest.raises(ConfigurationError, match="multiple device types: second device 'cpu:0'"):
        cpu.parse_from_string("/gpu:0/cpu:0")
