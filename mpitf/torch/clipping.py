"""``clip_grad_norm_`` in a mpitf.torch loop means what it means under DDP.

Under DDP the loop's ``clip_grad_norm_`` runs after the all-reduce: it clips the workers'
mean gradient by that mean's norm, before any of it is applied. In a mpitf.torch loop the
gradient is still this worker's own when the loop clips it; clipping it here would clip
each worker's gradient before the average (another update). So in sync mode the ps clips
(:mod:`mpitf.ps.clip`): while a :class:`~mpitf.torch.DistributedOptimizer` is open, torch's
clipping functions look at the parameters they are given, and for the wrapped model's they
leave the gradients as they are and note ``max_norm``, which travels to every ps with the
step's push. The norm they return is overwritten at ``step()`` with the norm the ps tasks
agreed on (the mean's, before clipping). In the other modes every push is applied alone,
so torch's own clipping of this worker's gradient is the one to run, and it runs.

torch's ``clip_grad_norm_`` calls ``_get_total_norm`` and ``_clip_grads_with_norm_`` of
``torch.nn.utils.clip_grad`` by their module's names, so replacing those two (and their
public names ``get_total_norm``/``clip_grads_with_norm_``) catches every way a loop calls
it, a reference taken before wrapping included (torch 2.6 and later; before, the
``clip_grad_norm_`` names themselves are replaced).
"""

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as _clip_grad

from ..errors import ConfigurationError
from ..worker.frontend import ends_the_job

__all__ = ["Clipping"]

_OPEN = []  # the open wrappers' Clipping, each claiming its model's parameters
_TORCH = {}  # (module, name) -> torch's own function, while replaced


def _tensors(given):
    return [given] if isinstance(given, torch.Tensor) else list(given)


def _owner(parameters):
    """Return the open :class:`Clipping` whose parameters ``parameters`` are, or None."""
    for clipping in _OPEN:
        if clipping.claims(parameters):
            return clipping
    return None


def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    tensors = _tensors(tensors)
    for clipping in _OPEN:
        clipping.check_norm_type(tensors, norm_type)
    return _TORCH[_clip_grad, "_get_total_norm"](tensors, norm_type, error_if_nonfinite,
                                                 foreach)


def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    parameters = _tensors(parameters)
    owner = _owner(parameters)
    if owner is None:
        return _TORCH[_clip_grad, "_clip_grads_with_norm_"](parameters, max_norm, total_norm,
                                                            foreach)
    owner.note(max_norm, total_norm)
    return None


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                     foreach=None):
    """Clip as torch before 2.6 does (no ``_clip_grads_with_norm_``): the whole function."""
    parameters = _tensors(parameters)
    owner = _owner(parameters)
    if owner is None:
        return _TORCH[_clip_grad, "clip_grad_norm_"](parameters, max_norm, norm_type,
                                                     error_if_nonfinite, foreach)
    owner.check_norm_type([p.grad for p in parameters if p.grad is not None], norm_type)
    with torch.no_grad():
        total = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in parameters if p.grad is not None]))
    owner.note(max_norm, total)
    return total


def _replacements():
    """Return ``[(module, name, replacement)]`` for this torch."""
    if hasattr(_clip_grad, "_clip_grads_with_norm_"):
        named = {"_get_total_norm": _get_total_norm, "get_total_norm": _get_total_norm,
                 "_clip_grads_with_norm_": _clip_grads_with_norm_,
                 "clip_grads_with_norm_": _clip_grads_with_norm_}
    else:
        named = {"clip_grad_norm_": _clip_grad_norm_}
    return [(module, name, f) for name, f in named.items()
            for module in (_clip_grad, torch.nn.utils) if hasattr(module, name)]


def _install():
    for module, name, replacement in _replacements():
        _TORCH[module, name] = getattr(module, name)
        setattr(module, name, replacement)


def _uninstall():
    for module, name, _ in _replacements():
        setattr(module, name, _TORCH[module, name])
    _TORCH.clear()


class Clipping:
    """One wrapper's clipping: the ``max_norm`` its loop asked for this step, and the norms.

    Args:
        parameters: the wrapped model's trained parameters.
        grads: the buffers their gradients lie in (torch views).
        refusal: a message refusing any clipping of them (the session clips already, or
            the model has tables), or None.
    """

    def __init__(self, parameters, grads, refusal=None):
        self._server = None  # a refusal ends every rank of a multi-rank job (ends_the_job)
        self._ids = {id(p) for p in parameters}
        self._grads = {g.data_ptr() for g in grads}
        self._refusal = refusal
        self.max_norm = None  # this step's, once the loop clipped
        self.clipped = False  # the loop clipped at some step: every step says its own
        self._norms = []  # the tensors torch returned this step, to hold the ps's norm

    @classmethod
    def for_session(cls, session, named, grads, tables):
        """Return the open Clipping of a wrapper's ``session`` (sync mode), else None.

        In the other modes each push is applied alone and torch clips it on the worker.
        """
        if not session.consistency.clips_on_ps:
            return None
        refusal = None
        if session.config.clip_norm is not None:
            refusal = ("clip_grad_norm_ in the loop and the session's clip_norm both clip the "
                       "mean gradient: give one")
        elif tables:
            refusal = ("clip_grad_norm_ over a model with mpitf.torch tables: the ps clips "
                       "the dense parameters only (not yet the tables' rows); drop the clip")
        clipping = cls([p for _, p in named], grads, refusal)
        clipping._server = session.server
        clipping.open()
        return clipping

    def open(self):
        """Watch torch's clipping functions for this wrapper's parameters."""
        if not _OPEN:
            _install()
        _OPEN.append(self)

    def close(self):
        """Stop watching; the last wrapper closed gives torch its functions back."""
        if self in _OPEN:
            _OPEN.remove(self)
            if not _OPEN:
                _uninstall()

    @ends_the_job
    def claims(self, parameters):
        """Return True for all of this model's parameters that have a gradient.

        Some of them only, or them with others, is refused: the ps clips the norm of the
        whole mean gradient.
        """
        given = [p for p in parameters if p.grad is not None]
        ours = [id(p) in self._ids for p in given]
        if not any(ours):
            return False
        if not all(ours) or len({id(p) for p in given}) != len(self._ids):
            raise ConfigurationError(
                "clip_grad_norm_ over part of the wrapped model's parameters, or over them "
                "and others: under mpitf (as under DDP) it clips the workers' mean gradient, "
                "whose norm the ps tasks compute over all the model's trained parameters; "
                "pass model.parameters()")
        return True

    @ends_the_job
    def check_norm_type(self, grads, norm_type):
        """Refuse a norm other than L2 of this model's gradients (the ps's is L2)."""
        if float(norm_type) != 2.0 and any(g.data_ptr() in self._grads for g in grads):
            raise ConfigurationError(
                f"clip_grad_norm_ with norm_type={norm_type} over a wrapped model: the ps "
                "tasks clip the mean gradient by its L2 norm; use norm_type=2")

    @ends_the_job
    def note(self, max_norm, total_norm):
        """The loop clipped this model's gradient: keep ``max_norm`` and the returned norm."""
        if self._refusal is not None:
            raise ConfigurationError(self._refusal)
        max_norm = float(max_norm)
        if not max_norm > 0:
            raise ConfigurationError(f"clip_grad_norm_ with max_norm={max_norm}: the ps clips "
                                     "to a positive norm")
        if self.max_norm is not None and max_norm != self.max_norm:
            raise ConfigurationError(
                f"clip_grad_norm_ twice in a step with max_norm {self.max_norm} and "
                f"{max_norm}: the ps clips the step's mean gradient once")
        self.max_norm, self.clipped = max_norm, True
        self._norms.append(total_norm)

    @ends_the_job
    def ask(self, rates, pushed, step):
        """Set the norm the step's push asks the ps to clip to (0.0: none; None: never).

        ``pushed``: backward's hooks already pushed buckets, with the last step's norm in
        ``rates`` (:class:`~mpitf.worker.rates.GroupRates`); another one is refused.
        """
        clip = (self.max_norm or 0.0) if self.clipped else None
        if pushed and clip != rates.clip_norm:
            def said(norm):
                return f"clipping to {norm}" if norm else "no clipping"
            raise ConfigurationError(
                f"step {step} asks the ps for {said(clip)} (clip_grad_norm_), but backward "
                f"had already pushed its buckets with the last step's {said(rates.clip_norm)}"
                ": call clip_grad_norm_ with one max_norm at every step from the first on, "
                "or pass bucket_bytes=0 (one frame per ps, pushed at step())")
        rates.clip_norm = clip

    def finish(self, norm):
        """After the step: write the ps's ``norm`` into the tensors torch returned; reset."""
        if norm is not None:
            with torch.no_grad():
                for tensor in self._norms:
                    tensor.fill_(norm)
        self._norms.clear()
        self.max_norm = None
