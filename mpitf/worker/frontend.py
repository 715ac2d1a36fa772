"""``SessionFrontEnd``: what each framework's ``DistributedOptimizer`` shares.

mpitf.torch and mpitf.jax differ in how gradients reach the push buffer; stopping,
closing, the exit code and the context manager are their session's, written once here.
"""

import functools

from ..errors import ConfigurationError
from ..runtime.exits import end_job

__all__ = ["SessionFrontEnd", "ends_the_job"]


def ends_the_job(method):
    """Decorate a front end's method: a configuration it cannot run ends every rank.

    The refusal is printed once, as one line that names the parameter and what to do,
    and every rank exits non-zero (:func:`~mpitf.runtime.exits.end_job`), as a job's bad
    flag does. In one process (no server, or a world of one) it is raised as it is.
    """
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ConfigurationError as exc:
            server = getattr(self, "_server", None)
            if server is None or server.comm.Get_size() < 2:
                raise
            end_job(exc, first=server.replica_index in (0, None))
    return wrapper


class SessionFrontEnd:
    """Base of a wrapper that holds a :class:`~.session.TrainingSession` in ``session``."""

    session = None

    @property
    def global_step(self):
        """Return the global step of the last reply."""
        return self.session.global_step

    def should_stop(self):
        """Return True once the last step is reached or a signal asked to stop."""
        return self.session.should_stop()

    def close(self):
        """Checkpoint at the end (chief), tell every ps this worker is done; return exit_code."""
        self.session.close()
        return self.exit_code

    @property
    def exit_code(self):
        """Return this rank's exit code (75 after a signal with a checkpoint cut)."""
        return self.session.exit_code

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        return False
