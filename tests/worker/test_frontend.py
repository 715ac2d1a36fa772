"""The tables' front end mpitf.torch and mpitf.jax share: once per step, evaluation unpushed."""

import pytest

from mpitf.errors import ConfigurationError
from mpitf.ps.optimizers import make_optimizer
from mpitf.worker.frontend import SessionFrontEnd, check_sparse_rule


class _Session:
    """A session's table calls only (TrainingSession.lookup and table_lookups)."""

    global_step = 3

    def __init__(self):
        self.table_lookups = {}
        self.calls = []

    def lookup(self, ids, push=True):
        self.calls.append((dict(ids), push))
        found = {name: f"rows of {name}" for name in ids}
        if push:
            self.table_lookups.update(found)
        return found


class _FrontEnd(SessionFrontEnd):
    ONCE_PER_STEP = "look it up once"

    def __init__(self):
        self.session = _Session()


def test_a_table_is_looked_up_once_per_step_and_an_evaluation_is_not_pushed():
    front = _FrontEnd()
    assert front.lookup_rows("user", [1, 2], train=False) == "rows of user"
    assert front.session.table_lookups == {}  # an evaluation's rows leave nothing to push
    assert front.lookup_rows("user", [4]) == "rows of user"
    assert front.lookup_rows("item", [5]) == "rows of item"  # another table: fine
    assert [push for _, push in front.session.calls] == [False, True, True]
    with pytest.raises(ConfigurationError, match=r"^table 'user' was looked up twice before "
                                                 r"step\(\) at step 3: look it up once$"):
        front.lookup_rows("user", [6])
    assert len(front.session.calls) == 3  # refused before pulling


def test_the_sparse_update_equals_the_dense_one_for_these_rules_only():
    for good in ("sgd", "adagrad", "torch_sgd", "torch_adagrad"):
        check_sparse_rule(make_optimizer(good, 0.1), ["user"])
    with pytest.raises(ConfigurationError, match="by 'torch_sgd' with momentum=0.9 on the ps"):
        check_sparse_rule(make_optimizer("torch_sgd", 0.1, momentum=0.9), ["user"])
    with pytest.raises(ConfigurationError, match=r"by Adam\(\) on the ps: .* only for SGD"):
        check_sparse_rule(make_optimizer("adam", 0.1), ["user"], label="Adam()", fix="SGD")
