"""mpitf.torch's clip_grad_norm_ watch (mpitf/torch/clipping.py), in one process.

While a wrapper's Clipping is open, torch's clip_grad_norm_ of its parameters notes
max_norm and leaves the gradients alone (the ps clips the mean); any other model is
clipped by torch as ever; part of the model, or another norm, is refused by name.
"""

import pytest
import torch

from mpitf.errors import ConfigurationError
from mpitf.torch.clipping import Clipping


def _model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    return model


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_the_wrapped_models_clip_is_noted_and_others_are_clipped_by_torch():
    ours, theirs = _model(0), _model(1)
    original = torch.nn.utils.clip_grad._clip_grads_with_norm_
    clipping = Clipping(list(ours.parameters()), [p.grad for p in ours.parameters()])
    clipping.open()
    try:
        before, reference = _grads(ours), _model(1)
        norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.01)
        assert all(torch.equal(a, p.grad) for a, p in zip(before, ours.parameters()))
        assert clipping.max_norm == 0.01
        # a reference taken before: the same watch (torch calls the module's names)
        from torch.nn.utils.clip_grad import clip_grad_norm_
        assert clip_grad_norm_(ours.parameters(), 0.01) is not None
        # another model: torch's own clipping, in place
        theirs_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.01)
        assert float(theirs_norm) > 0.01
        total = torch.sqrt(sum(p.grad.square().sum() for p in theirs.parameters()))
        assert float(total) == pytest.approx(0.01, rel=1e-4)
        assert float(total) < float(torch.sqrt(sum(
            p.grad.square().sum() for p in reference.parameters())))
        # after the step: the ps's norm is what clip_grad_norm_ returned, max_norm reset
        clipping.finish(3.5)
        assert float(norm) == 3.5 and clipping.max_norm is None and clipping.clipped
    finally:
        clipping.close()
    assert torch.nn.utils.clip_grad._clip_grads_with_norm_ is original  # torch's again
    assert torch.nn.utils.clip_grads_with_norm_ is original


@pytest.mark.parametrize("call,words", [
    (lambda m: torch.nn.utils.clip_grad_norm_(m[0].parameters(), 1.0),
     "clip_grad_norm_ over part of the wrapped model's parameters"),
    (lambda m: torch.nn.utils.clip_grad_norm_(list(m.parameters()) + list(_model(2).parameters()),
                                              1.0),
     "clip_grad_norm_ over part of the wrapped model's parameters, or over them and others"),
    (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type="inf"),
     "clip_grad_norm_ with norm_type=inf over a wrapped model: the ps tasks clip the mean "
     "gradient by its L2 norm"),
])
def test_clipping_part_of_the_model_or_by_another_norm_is_refused(call, words):
    model = _model(0)
    clipping = Clipping(list(model.parameters()), [p.grad for p in model.parameters()])
    clipping.open()
    try:
        with pytest.raises(ConfigurationError, match=words.replace("(", r"\(")):
            call(model)
    finally:
        clipping.close()


def test_a_step_that_changes_its_clip_after_buckets_left_is_refused():
    class Rates:
        clip_norm = 0.5

    model = _model(0)
    clipping = Clipping(list(model.parameters()), [p.grad for p in model.parameters()])
    clipping.note(0.5, torch.tensor(1.0))
    rates = Rates()
    clipping.ask(rates, True, 4)  # the same as the last step's: fine
    assert rates.clip_norm == 0.5
    clipping.finish(None)
    with pytest.raises(ConfigurationError, match="step 5 asks the ps for no clipping"):
        clipping.ask(rates, True, 5)
    clipping.ask(rates, False, 5)  # pushed at step(): it travels with the push
    assert rates.clip_norm == 0.0
