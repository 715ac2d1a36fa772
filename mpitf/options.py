"""An option written once: a dataclass field whose metadata is its flag, help and check.

A configuration class declares each option with :func:`option`; from that one declaration

- :func:`add_flags` adds its argparse flag (the type from the field's annotation, a bool a
  switch, the default the field's unless the flag's differs, written beside it),
- :func:`values_from_args` reads the parsed flags back into field values, and
- :func:`check_fields` runs its check when the dataclass is built.

A field whose default is None takes None as "none" or "the default" (its help says which)
and is checked only when it holds a value. Options that refuse each other are checked by
the class itself, beside its fields.
"""

import dataclasses

from .checks import check_choice, check_int, check_number

__all__ = ["add_flags", "check_fields", "integer", "number", "option", "values_from_args"]

_FIELD = object()  # a flag whose default is the field's


def option(default=None, *flags, help, check=None, choices=None, flag_choices=_FIELD,
           label=None, flag_default=_FIELD, dest=None, group="training", resolve=None,
           default_factory=None):
    """Return a dataclass field declaring one option.

    Args:
        default: the field's default.
        flags: its command-line names, the first giving the argparse ``dest`` (none: no flag).
        help: what it is, for the flag's help and the reader of the class.
        check: ``check(label, value)`` raises a ConfigurationError for a bad value; what it
            returns is stored (so a list can become a tuple).
        choices: the values allowed, checked and offered by the flag.
        flag_choices: the choices the flag offers, where they differ (None: the flag takes
            any string and the check refuses it, once on rank 0, like any other value).
        label: how messages name the option (default: the field's name).
        flag_default: the flag's default where it differs from the field's; a callable is
            called when the parser is built (an environment variable read then).
        dest: the argparse ``dest``, where the first flag does not give it.
        group: the flags' group in ``--help``.
        resolve: ``resolve(config)`` chooses the value from other fields when None is given.
        default_factory: makes the field's default when an instance is built, instead of
            ``default`` (a value read from the environment then).
    """
    metadata = dict(flags=flags, help=help, check=check, choices=choices,
                    flag_choices=choices if flag_choices is _FIELD else flag_choices,
                    label=label, flag_default=flag_default, dest=dest, group=group,
                    resolve=resolve)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def integer(low=None):
    """Return a check: an integer >= ``low``."""
    def check(name, value):
        check_int(name, value, low)
        return value
    return check


def number(**bounds):
    """Return a check: a finite real number within ``bounds`` (those of ``check_number``)."""
    def check(name, value):
        check_number(name, value, **bounds)
        return value
    return check


def _options(cls):
    """Yield the fields of ``cls`` declared with :func:`option`."""
    for f in dataclasses.fields(cls):
        if f.init and "flags" in f.metadata:
            yield f


def _dest(f):
    meta = f.metadata
    return meta["dest"] or meta["flags"][0].lstrip("-").replace("-", "_")


def check_fields(config):
    """Check every option of ``config`` (a dataclass instance) and store what the checks return.

    Returns the names of the fields whose value ``resolve`` chose, None having been given.
    """
    chosen = []
    for f in _options(type(config)):
        meta, value = f.metadata, getattr(config, f.name)
        if value is None and meta["resolve"] is not None:
            value = meta["resolve"](config)
            chosen.append(f.name)
        if value is None and f.default is None:
            continue
        label = meta["label"] or f.name
        if meta["choices"] is not None:
            check_choice(label, value, meta["choices"])
        if meta["check"] is not None:
            value = meta["check"](label, value)
        if value is not getattr(config, f.name):
            object.__setattr__(config, f.name, value)  # frozen: set once, while being built
    return frozenset(chosen)


def add_flags(parser, cls, defaults=None, _groups=None):
    """Add a flag to ``parser`` for each option of ``cls`` (and of its dataclass fields).

    ``defaults`` maps field names to a job's own flag defaults (a job that trains longer).
    """
    defaults = defaults or {}
    groups = {} if _groups is None else _groups
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            add_flags(parser, f.type, defaults, groups)
            continue
        if not f.init or not f.metadata.get("flags"):
            continue
        meta = f.metadata
        title = meta["group"]
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        kwargs = dict(help=meta["help"])
        if meta["dest"]:
            kwargs["dest"] = meta["dest"]
        if f.type is bool:
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            default = meta["flag_default"]
            if f.name in defaults and defaults[f.name] is not None:
                default = defaults[f.name]
            elif default is _FIELD:
                default = f.default
            elif callable(default):
                default = default()
            kwargs["default"] = default
            if f.type in (int, float):
                kwargs["type"] = f.type
            if meta["flag_choices"] is not None:
                kwargs["choices"] = meta["flag_choices"]
        groups[title].add_argument(*meta["flags"], **kwargs)
    return parser


def values_from_args(cls, args):
    """Return the field values of ``cls`` that the parsed flags ``args`` give.

    A flag left at None leaves its field out, so the field's default (or its ``resolve``)
    applies; a dataclass field is built from the same flags.
    """
    values = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            values[f.name] = f.type(**values_from_args(f.type, args))
        elif f.init and f.metadata.get("flags"):
            value = getattr(args, _dest(f))
            if value is not None:
                values[f.name] = value
    return values
