"""Sphinx directives of mpitf's site: the command-line reference, made from the parsers.

``{mpitf-cli}`` documents the ``mpitf`` command, one section per subcommand, from
``mpitf.cli.main.build_parser()``; ``{mpitf-job} NAME`` documents the flags of the built-in
job ``mpitf.jobs.NAME`` (or of a checkout's script, ``jobs/NAME.py``), whose parser its
``main()`` builds: the directive calls ``main()``
with ``parse_args`` replaced by one that hands the parser back before anything runs. No
flag is copied into the pages, so the reference cannot drift from the code.
"""

import argparse
import importlib
import importlib.util
import os
import re

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Parsed(Exception):
    """Carries the parser a job's ``main()`` built out of it, before it parses anything."""

    def __init__(self, parser):
        super().__init__(parser.prog)
        self.parser = parser


def job_parser(name):
    """Return the argparse parser a job's ``main()`` builds.

    ``name`` is a built-in job (``mnist_mlp``: ``mpitf.jobs.mnist_mlp``) or a script of the
    checkout (``jobs/torch_mnist.py``), whose ``main()`` is called with no arguments.
    """
    if name.endswith(".py"):
        path = os.path.join(os.path.dirname(DOCS), name)
        spec = importlib.util.spec_from_file_location(f"_mpitf_docs_{len(name)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        call, prog = module.main, f"python {name}"
    else:
        module = importlib.import_module(f"mpitf.jobs.{name}")
        call, prog = (lambda: module.main([])), f"python -m mpitf.jobs.{name}"

    def hand_back(parser, *args, **kwargs):
        raise _Parsed(parser)

    saved = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = hand_back
    try:
        call()
    except _Parsed as parsed:
        parser = parsed.parser
    else:
        raise RuntimeError(f"{name}: main() returned without parsing its flags")
    finally:
        argparse.ArgumentParser.parse_args = saved
    parser.prog = prog
    return parser


def _escape(text):
    """Escape Markdown: help strings are plain text (CommonMark escapes any punctuation)."""
    return re.sub(r"([!-/:-@\[-`{-~])", r"\\\1", " ".join(text.split()))


def _help(parser, action):
    """Return an action's help with its ``%(default)s``-style fields filled in."""
    return parser._get_formatter()._expand_help(action) if action.help else ""


def _option_lines(parser, program):
    """Yield MyST lines documenting ``parser``'s arguments as options of ``program``."""
    yield f"```{{program}} {program}"
    yield "```"
    yield ""
    yield "```text"
    yield from parser.format_usage().rstrip().splitlines()
    yield "```"
    yield ""
    if parser.description:
        yield _escape(parser.description)
        yield ""
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        if action.option_strings:
            takes = "" if action.nargs == 0 else " " + (
                action.metavar or action.dest.upper())
            names = ", ".join(f"{opt}{takes}" for opt in action.option_strings)
        else:
            names = action.metavar or action.dest
        text = _escape(_help(parser, action))
        default = action.default
        if action.option_strings and action.nargs != 0 and default not in (None, "") \
                and default is not argparse.SUPPRESS and "default" not in text:
            text += f" (default: `{default}`)"
        yield f"```{{option}} {names}"
        yield text or "(no help)"
        yield "```"
        yield ""
    if parser.epilog:
        yield _escape(parser.epilog)
        yield ""


class _ParserDirective(SphinxDirective):
    """Base: render lines made from parsers into the page."""

    def render(self, lines):
        """Parse ``lines`` (MyST Markdown, as the page) into nodes, sections included."""
        container = nodes.Element()
        nested_parse_with_titles(self.state, StringList(list(lines), "<mpitf-cli>"), container)
        return container.children


class CliDirective(_ParserDirective):
    """``{mpitf-cli}``: the ``mpitf`` command and each of its subcommands."""

    def run(self):
        """Document ``build_parser()``'s command and subcommands."""
        from mpitf.cli.main import build_parser

        parser = build_parser()
        lines = list(_option_lines(parser, "mpitf"))
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        helps = {choice.dest: choice.help for choice in sub._choices_actions}
        for name, subparser in sub.choices.items():
            title = f"mpitf {name}"
            lines += [f"### {title}", ""]
            if helps.get(name):
                lines += [_escape(helps[name].capitalize()) + ".", ""]
            lines += list(_option_lines(subparser, title))
        return self.render(lines)


class JobDirective(_ParserDirective):
    """``{mpitf-job} NAME``: the flags of the built-in job ``mpitf.jobs.NAME``."""

    required_arguments = 1

    def run(self):
        """Document the job's parser."""
        name = self.arguments[0]
        program = name if name.endswith(".py") else f"mpitf.jobs.{name}"
        return self.render(_option_lines(job_parser(name), program))


def setup(app):
    """Register the directives."""
    app.add_directive("mpitf-cli", CliDirective)
    app.add_directive("mpitf-job", JobDirective)
    app.connect("missing-reference", _public_alias)
    app.connect("missing-reference", _existing_name, priority=900)
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    GoogleDocstring._parse_attribute_docstring = _plain_property_docstring
    return {"parallel_read_safe": True, "parallel_write_safe": True}


def _public_alias(app, env, node, contnode):
    """Resolve ``mpitf.mod.Name`` to ``mpitf.Name`` where ``Name`` is that public object.

    The docstrings name classes by their module (``mpitf.runtime.server.Server``), which is
    what Python reports; the reference documents them where users import them from.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module, _, name = target.rpartition(".")
    if not module.startswith("mpitf"):
        return None
    import mpitf

    for package in (mpitf, _import("mpitf.torch"), _import("mpitf.jax")):
        if package is None or name not in getattr(package, "__all__", ()):
            continue
        obj = getattr(package, name)
        if getattr(obj, "__module__", None) == module or module == package.__name__:
            domain = env.get_domain("py")
            alias = node.copy()
            alias["reftarget"] = f"{package.__name__}.{name}"
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                                       alias["reftarget"], alias, contnode)
    return None


def _existing_name(app, env, node, contnode):
    """Show a reference to a name that exists in the code but not in the reference as text.

    The docstrings name private helpers and internal modules (``mpitf.tables.rowkernels``)
    that the reference leaves out on purpose; such a name is checked to exist (imported and
    looked up, relative to the docstring's module and class), so a misspelt or removed name
    still fails the build.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module, cls = node.get("py:module") or "", node.get("py:class") or ""
    scopes = [f"{module}.{cls}", module, module.rpartition(".")[0], ""]
    # and the scopes of the docstring's own object ("mpitf/x.py:docstring of mpitf.x.f")
    origin = re.search(r"docstring of ([\w.]+)", node.source or "")
    parts = origin[1].split(".") if origin else []
    scopes += [".".join(parts[:cut]) for cut in range(len(parts), 0, -1)]
    for scope in scopes:
        if _resolves(f"{scope}.{target}" if scope else target):
            return contnode
    return None


def _resolves(dotted):
    """Whether ``dotted`` names an importable module or an attribute under one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        obj = _import(".".join(parts[:cut]))
        if obj is None:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _plain_property_docstring(self):
    """Keep a property's docstring as written: mpitf's are sentences, not "type: text"."""
    return list(self._consume_to_end())


def _import(name):
    """Return module ``name``, or None where its framework is not installed."""
    try:
        return importlib.import_module(name)
    except (ImportError, ValueError, TypeError):  # an empty or relative name
        return None
