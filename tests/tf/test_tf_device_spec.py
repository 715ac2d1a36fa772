"""TensorFlow's own DeviceSpec tests, run against mpitf.

Origin: tensorflow/python/framework/device_spec_test.py (Apache License 2.0, The
TensorFlow Authors), class DeviceSpecTest; each test below names the TF test it
follows. The cases and expected values are TF's; the changes:
- imports: ``mpitf.cluster.device.DeviceSpec`` for ``device_spec.DeviceSpecV2``; pytest
  functions for the parameterized ``TensorFlowTestCase`` methods, run for V2 only.
- mpitf's DeviceSpec is TensorFlow 2's, immutable (a design choice: one spec type):
  the V1-only tests that mutate a spec (``testto_string_legacy``,
  ``test_parse_legacy``, ``test_merge_legacy``) are left out, and
  ``test_merge_removed`` holds as in TF 2.
- TF's error reads "Multiple device types are not allowed"; mpitf's starts
  "multiple device types", so the match ignores case.
"""

import pytest

from mpitf.cluster.device import DeviceSpec


def test_empty():  # test_empty
    d = DeviceSpec()
    assert d.to_string() == ""
    d.parse_from_string("")
    assert d.to_string() == ""
    assert d.parse_from_string("").to_string() == ""


def test_constructor():  # test_constructor
    d = DeviceSpec(job="j", replica=0, task=1, device_type="CPU", device_index=2)
    assert (d.job, d.replica, d.task, d.device_type, d.device_index) == ("j", 0, 1, "CPU", 2)
    assert d.to_string() == "/job:j/replica:0/task:1/device:CPU:2"
    assert DeviceSpec(device_type="GPU", device_index=0).to_string() == "/device:GPU:0"


def test_replace():  # test_replace
    d = DeviceSpec().replace(job="foo")
    assert d.to_string() == "/job:foo"
    d = d.replace(task=3)
    assert d.to_string() == "/job:foo/task:3"
    d = d.replace(device_type="CPU", device_index=0)
    assert d.to_string() == "/job:foo/task:3/device:CPU:0"
    d = d.replace(task=None, replica=12)
    assert d.to_string() == "/job:foo/replica:12/device:CPU:0"
    d = d.replace(device_type="GPU", device_index=2)
    assert d.to_string() == "/job:foo/replica:12/device:GPU:2"
    d = d.replace(device_type="CPU", device_index=1)
    assert d.to_string() == "/job:foo/replica:12/device:CPU:1"
    d = d.replace(device_type=None, device_index=None)
    assert d.to_string() == "/job:foo/replica:12"
    d = DeviceSpec(job="foo", replica=12, task=3, device_type="GPU")
    assert d.to_string() == "/job:foo/replica:12/task:3/device:GPU:*"


@pytest.mark.parametrize("fields, text", [  # testto_string
    ({"job": "foo"}, "/job:foo"),
    ({"job": "foo", "task": 3}, "/job:foo/task:3"),
    ({"job": "foo", "task": 3, "device_type": "cpu", "device_index": 0},
     "/job:foo/task:3/device:CPU:0"),
    ({"job": "foo", "replica": 12, "device_type": "cpu", "device_index": 0},
     "/job:foo/replica:12/device:CPU:0"),
    ({"job": "foo", "replica": 12, "device_type": "gpu", "device_index": 2},
     "/job:foo/replica:12/device:GPU:2"),
    ({"job": "foo", "replica": 12}, "/job:foo/replica:12"),
    ({"job": "foo", "replica": 12, "task": 3, "device_type": "GPU"},
     "/job:foo/replica:12/task:3/device:GPU:*"),
])
def test_to_string(fields, text):
    assert DeviceSpec(**fields).to_string() == text


def test_to_from_string():  # test_to_from_string
    d = DeviceSpec.from_string("/job:foo/replica:0")
    assert d.to_string() == "/job:foo/replica:0" and d.replica == 0
    d = DeviceSpec.from_string("/replica:1/task:0/cpu:0")
    assert d.to_string() == "/replica:1/task:0/device:CPU:0"
    assert [d.replica, d.task, d.device_type, d.device_index] == [1, 0, "CPU", 0]
    d = DeviceSpec.from_string("/replica:1/task:0/device:CPU:0")
    assert d.to_string() == "/replica:1/task:0/device:CPU:0"
    assert [d.replica, d.task, d.device_type, d.device_index] == [1, 0, "CPU", 0]
    d = DeviceSpec.from_string("/job:muu/device:GPU:2")
    assert d.to_string() == "/job:muu/device:GPU:2"
    assert [d.job, d.device_type, d.device_index] == ["muu", "GPU", 2]
    with pytest.raises(ValueError, match="(?i)multiple device types"):
        d.parse_from_string("/job:muu/device:GPU:2/cpu:0")


def test_merge_removed():  # test_merge_removed
    with pytest.raises(AttributeError):
        DeviceSpec().merge_from(DeviceSpec.from_string("/task:1/cpu:0"))


def test_combine():  # test_combine
    d = DeviceSpec.from_string("/job:foo/replica:0")
    assert d.to_string() == "/job:foo/replica:0"
    d = d.make_merged_spec(DeviceSpec.from_string("/task:1/device:GPU:2"))
    assert d.to_string() == "/job:foo/replica:0/task:1/device:GPU:2"
    d = DeviceSpec().make_merged_spec(DeviceSpec.from_string("/task:1/cpu:0"))
    assert d.to_string() == "/task:1/device:CPU:0"
    d = d.make_merged_spec(DeviceSpec.from_string("/job:boo/device:GPU:0"))
    assert d.to_string() == "/job:boo/task:1/device:GPU:0"
    d = d.make_merged_spec(DeviceSpec.from_string("/job:muu/cpu:2"))
    assert d.to_string() == "/job:muu/task:1/device:CPU:2"
    d = d.make_merged_spec(DeviceSpec.from_string("/job:muu/device:MyFunnyDevice:2"))
    assert d.to_string() == "/job:muu/task:1/device:MyFunnyDevice:2"
