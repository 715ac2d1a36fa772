"""How a table that grows admits and evicts its rows: the options, declared once.

A table whose ``rows`` is None (``EmbeddingTable(..., dynamic=Growth(...))``) takes any
int64 id; a ps makes a row when an id is admitted. The fields are options
(:func:`mpitf.options.option`): a job adds their flags with ``add_flags(parser, Growth)``
and builds one with ``Growth(**values_from_args(Growth, args))``.
"""

from dataclasses import dataclass

from ..options import check_fields, integer, number, option

__all__ = ["Growth"]


@dataclass(frozen=True)
class Growth:
    """Admission and eviction of a dynamic table's rows (by default: every id, none evicted).

    Each field but ``negative_ids`` is also a flag of the jobs (``--admit-min-count`` ...,
    in the "dynamic tables" group), whose help says the same.

    Args:
        admit_min_count: an id gets a row once this many pushes carried its gradient;
            until then it reads zeros and its gradients are counted, not applied.
        admit_probability: an id that reached ``admit_min_count`` gets a row with this
            probability per push (a draw of seed, table, id and count: the same in every
            run).
        evict_after_steps: evict the rows no gradient reached for this many steps
            (None: never).
        capacity: the rows one ps holds of each table at most; beyond, the least used
            rows are evicted (None: no limit).
        evict_every: run the ``evict_after_steps`` eviction every this many steps (None:
            at each checkpoint).
        negative_ids: False makes a negative id bad input, refused by the worker.

    Raises:
        ConfigurationError: a value out of range.
    """

    admit_min_count: int = option(
        1, "--admit-min-count", check=integer(1), group="dynamic tables",
        help="an id gets a row once this many pushes carried its gradient; until then it "
             "reads zeros and its gradients are counted, not applied")
    admit_probability: float = option(
        1.0, "--admit-probability", group="dynamic tables",
        check=number(low=0.0, high=1.0, low_open=True, high_open=False),
        help="an id that reached --admit-min-count gets a row with this probability per "
             "push (a draw of seed, table, id and count: the same in every run)")
    evict_after_steps: int = option(
        None, "--evict-after-steps", check=integer(1), group="dynamic tables",
        help="evict the rows no gradient reached for this many steps (default: never)")
    capacity: int = option(
        None, "--table-capacity", check=integer(1), group="dynamic tables",
        help="rows one ps holds of each table at most; beyond, the least used rows are "
             "evicted (a warning with the numbers; default: no limit)")
    evict_every: int = option(
        None, "--evict-every", check=integer(1), group="dynamic tables",
        help="run --evict-after-steps every N steps (default: at each checkpoint)")
    negative_ids: bool = True  # False: a negative id is bad input (the worker refuses it)

    def __post_init__(self):
        check_fields(self)

    @property
    def admits_all(self):
        """Return True when every id gets a row the first time its gradient arrives."""
        return self.admit_min_count <= 1 and self.admit_probability >= 1.0
