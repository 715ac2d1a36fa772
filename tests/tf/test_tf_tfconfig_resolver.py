"""TensorFlow's own TFConfigClusterResolver tests, run against mpitf.

Origin: tensorflow/python/distribute/cluster_resolver/tfconfig_cluster_resolver_test.py
(Apache License 2.0, The TensorFlow Authors), class TFConfigClusterResolverTest; each test
below names the TF test it follows. The TF_CONFIG values and expected values are TF's; the
changes:
- imports: ``mpitf.cluster.resolvers.TFConfigClusterResolver``; pytest functions for
  ``test.TestCase`` methods; ``monkeypatch.setenv`` for ``os.environ[...] = ...``.
- no protobuf ``ClusterDef`` (a design choice: MPI needs no wire description of the
  cluster): where TF compares ``as_cluster_def()`` protos, these compare the spec, a copy
  of it and its ``as_dict()`` with the same jobs and tasks.
- no sessions or ops (a design choice: mpitf builds no graph, so it cannot list another
  task's devices): testNumAcceleratorsFilterTasksByEnvVar, which mocks a session's device
  list, is left out; mpitf's TFConfigClusterResolver has no ``num_accelerators()``.
"""

import pytest

from mpitf.cluster import ClusterSpec
from mpitf.cluster.resolvers import TFConfigClusterResolver

PS_WORKER = """
    {
      "cluster": {
        "ps": ["ps0:2222", "ps1:2222"],
        "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]
      },
      %s
      "task": {
        "type": "ps",
        "index": %s
      }
    }
"""


@pytest.fixture
def tf_config(monkeypatch):
    """Set TF_CONFIG for one test, as TF's tests set os.environ['TF_CONFIG']."""
    def set_config(value):
        monkeypatch.setenv("TF_CONFIG", value)
    return set_config


def _verify_cluster_spec_equality(spec, expected):
    for form in (spec, ClusterSpec(spec), ClusterSpec(spec.as_dict())):
        assert form == expected
        assert form.as_dict() == ClusterSpec(expected).as_dict()


def test_normal_cluster_spec_read(tf_config):  # testNormalClusterSpecRead
    tf_config(PS_WORKER % ("", "0"))
    expected = {"ps": {0: "ps0:2222", 1: "ps1:2222"},
                "worker": {0: "worker0:2222", 1: "worker1:2222", 2: "worker2:2222"}}
    _verify_cluster_spec_equality(TFConfigClusterResolver().cluster_spec(), expected)


def test_automatic_master_read(tf_config):  # testAutomaticMasterRead
    tf_config(PS_WORKER % ("", "0"))
    assert TFConfigClusterResolver().master() == "ps0:2222"


def test_specified_task_type_and_index_master_read(tf_config):
    # testSpecifiedTaskTypeAndIndexMasterRead
    tf_config(PS_WORKER % ("", "0"))
    assert TFConfigClusterResolver().master("worker", 1) == "worker1:2222"


def test_session_master_read(tf_config):  # testSessionMasterRead
    tf_config(PS_WORKER % ('"session_master": "sessionmaster:2222",', "0"))
    assert TFConfigClusterResolver().master() == "sessionmaster:2222"


def test_rpc_layer_read(tf_config):  # testRpcLayerRead
    tf_config(PS_WORKER % ('"rpc_layer": "grpc",', "0"))
    assert TFConfigClusterResolver().master() == "grpc://ps0:2222"


def test_task_type_index_rpc_read(tf_config):  # testTaskTypeIndexRpcRead
    tf_config(PS_WORKER % ('"rpc_layer": "grpc",', "0"))
    resolver = TFConfigClusterResolver()
    assert resolver.task_type == "ps"
    assert resolver.task_id == 0
    assert resolver.rpc_layer == "grpc"


def test_parameter_overrides(tf_config):  # testParameterOverrides
    tf_config(PS_WORKER % ('"rpc_layer": "grpc",', "1"))
    resolver = TFConfigClusterResolver(task_type="ps", task_id=0)
    assert resolver.master() == "grpc://ps0:2222"
    assert resolver.task_type == "ps"
    assert resolver.task_id == 0

    resolver.task_type = "worker"
    resolver.task_id = 1
    resolver.rpc_layer = "test"
    assert resolver.master() == "test://worker1:2222"
    assert resolver.task_type == "worker"
    assert resolver.task_id == 1
    assert resolver.rpc_layer == "test"


def test_task_type_cast_to_string(tf_config):  # testTaskTypeCastToString
    tf_config("""
    {
      "cluster": {
        "123456": ["ps0:2222", "ps1:2222"],
        "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]
      },
      "rpc_layer": "grpc",
      "task": {
        "type": 123456,
        "index": 0
      }
    }
    """)
    assert TFConfigClusterResolver().task_type == "123456"


def test_task_index_cast_to_integer(tf_config):  # testTaskIndexCastToInteger
    tf_config(PS_WORKER % ('"rpc_layer": "grpc",', '"1"'))
    assert TFConfigClusterResolver().task_id == 1


def test_task_index_override(tf_config):  # testTaskIndexOverride
    tf_config("""
    {
      "cluster": {
        "worker": ["worker0:2222", "worker1:2222"]
      },
      "task": {
        "type": "worker",
        "index": "0"
      }
    }
    """)
    assert TFConfigClusterResolver(task_id=1).task_id == 1


def test_zero_items_in_cluster_spec_master_read(tf_config):
    # testZeroItemsInClusterSpecMasterRead
    tf_config("""
    {}
    """)
    assert TFConfigClusterResolver().master() == ""


def test_one_item_in_cluster_spec_master_read(tf_config):
    # testOneItemInClusterSpecMasterRead
    tf_config("""
    {
      "cluster": {
        "worker": ["worker0:2222"]
      }
    }
    """)
    assert TFConfigClusterResolver().master() == ""
