"""TensorFlow's own replica_device_setter tests, run against mpitf.

Origin: tensorflow/python/training/device_setter_test.py (Apache License 2.0, The
TensorFlow Authors), class DeviceSetterTest; each test below names the TF test it
follows. The cluster and the expected ps task of each variable are TF's; the changes:
- imports: ``mpitf.placement.replica_device_setter`` and ``mpitf.cluster.ClusterSpec``.
- no ops (a design choice: mpitf places a model's variables, it builds no graph): TF
  reads ``v.device`` of variables created under ``tf.device(setter)``; here the setter
  places ``[(name, shape, dtype)]`` in creation order and the test reads each
  variable's ps task. What concerns op devices only (``ps_device``, ``worker_device``,
  ``merge_devices``, ``/cpu:0`` overrides, pinning a variable to another job:
  testCPUOverride, testPS2TasksPinVariableToJob, testPS2TasksUseCpuForPS,
  testPS2TasksNoMerging, testPS2TasksWithDevice, testPS2TasksWithCPUConstraint) is
  left out: every mpitf variable lives on a task of the ``ps`` job.
- no protobuf ``ClusterDef``: testPS2TasksWithClusterDef is left out.
"""

import numpy as np

from mpitf.cluster import ClusterSpec
from mpitf.placement import replica_device_setter

CLUSTER = ClusterSpec({"ps": ["ps0:2222", "ps1:2222"],
                       "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]})
V_AND_W = [("v", (2,), np.dtype(np.int32).str), ("w", (2,), np.dtype(np.int32).str)]


def ps_tasks(setter, variables):
    placement = setter.place(variables)
    return {name: [s.ps_task for s in placement.owner(name)] for name, _, _ in variables}


def test_ps2_tasks_with_cluster_spec_class():  # testPS2TasksWithClusterSpecClass
    assert ps_tasks(replica_device_setter(cluster=CLUSTER), V_AND_W) == {"v": [0], "w": [1]}


def test_ps2_tasks_with_cluster_spec_dict():  # testPS2TasksWithClusterSpecDict
    setter = replica_device_setter(cluster=CLUSTER.as_dict())
    assert ps_tasks(setter, V_AND_W) == {"v": [0], "w": [1]}


def test_resource():  # testResource: one (resource) variable goes to ps task 0
    assert ps_tasks(replica_device_setter(cluster=CLUSTER), V_AND_W[:1]) == {"v": [0]}
