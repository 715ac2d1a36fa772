"""The package's exceptions, so callers can catch mpitf's failures by kind."""


class MpitfError(Exception):
    """Base of every error mpitf raises on purpose."""


class ConfigurationError(MpitfError, ValueError):
    """A cluster spec, flag or option that cannot work; the message says how to fix it."""


class CollectiveError(ConfigurationError):
    """An error every rank raised alike, from the same facts: rank 0 says it, every rank exits 2.

    ``cause`` is the error each rank found (a bad spec or flag, a missing data file, a
    checkpoint directory another job holds); the message is its message. It is a
    configuration error: the job was started in a way that cannot work.
    """

    collective = True  # no rank needs to abort the others: each exits on its own

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause

    def __reduce__(self):
        return type(self), (self.cause,)


class DataError(MpitfError, ValueError):
    """A data file that is missing, incomplete or inconsistent; names the file and array."""


class CheckpointError(MpitfError):
    """A checkpoint that is missing, damaged, or does not fit the model."""


class PeerError(MpitfError):
    """A failure involving another rank; names the rank, its job/task, host and operation."""

    def __init__(self, message, *, rank=None, job=None, task=None, host=None, operation=None):
        self.rank, self.job, self.task, self.host, self.operation = rank, job, task, host, operation
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if job is not None:
            where.append(f"/job:{job}/task:{task}")
        if host:
            where.append(f"on {host}")
        if operation:
            where.append(f"during {operation}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class DeadlineError(PeerError):
    """A peer did not answer an outstanding request before its deadline."""


class NonFiniteGradientError(MpitfError, FloatingPointError):
    """A gradient holds NaN or Inf; names the variable."""
