"""The commands page (docs/reference/commands.md): every ``rtrl`` command and argument, nested subcommands too.

Walked from the ``rtrl`` argparse parser (``app.cli.parser()``) with a formatter of fixed width, so the
terminal's COLUMNS changes nothing.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from docs.gen_markdown import cell, code, header, rst_to_md, slug


def _wide_usage(p: argparse.ArgumentParser, prog: str) -> str:
    """The usage line, never wrapped (a formatter of fixed, huge width: COLUMNS does not matter)."""
    fmt = argparse.HelpFormatter(prog=prog, width=10_000, max_help_position=10_000)
    fmt.add_usage(p.usage, p._actions, p._mutually_exclusive_groups, prefix="")
    return " ".join(fmt.format_help().split())


def _expand_help(action: argparse.Action, prog: str) -> str:
    """The action's help with ``%(default)s`` and friends filled in, as argparse does."""
    text = action.help or ""
    if "%" not in text:
        return text
    params: dict[str, Any] = dict(vars(action), prog=prog)
    params = {k: v for k, v in params.items() if v is not argparse.SUPPRESS}
    for k, v in list(params.items()):
        if hasattr(v, "__name__"):
            params[k] = v.__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return text % params


def _argument_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return str(action.metavar or action.dest)
    name = ", ".join(action.option_strings)
    if action.nargs != 0:
        metavar = action.metavar or action.dest.upper()
        name += f" {metavar if isinstance(metavar, str) else ' '.join(metavar)}"
    return name


def _argument_notes(action: argparse.Action) -> str:
    notes = []
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        notes.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    raw = action.help or ""
    shown_default = action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0
    if shown_default and "%(default)" not in raw and not isinstance(action, argparse._VersionAction):
        notes.append(f"default: `{action.default}`")
    if action.required and action.option_strings:
        notes.append("required")
    return "; ".join(notes)


def _subcommands(p: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand of ``p``, in the order they were added (aliases once)."""
    out: list[tuple[str, str, argparse.ArgumentParser]] = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                out.append((name, helps.get(name, ""), sub))
    return out


def _options_of(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions if a.option_strings for s in a.option_strings}


def _command_section(
    p: argparse.ArgumentParser, path: list[str], global_opts: set[str], lines: list[str], level: int
) -> None:
    prog = " ".join(path)
    lines += [f"{'#' * level} `{prog}`", ""]
    if p.description:
        lines += [" ".join(p.description.split()), ""]
    lines += ["```", _wide_usage(p, prog), "```", ""]
    rows = []
    inherited = False
    for a in p._actions:
        if isinstance(a, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if a.option_strings and set(a.option_strings) <= global_opts and a.default is argparse.SUPPRESS:
            inherited = True
            continue
        rows.append(f"| {code(_argument_name(a))} | {cell(_expand_help(a, prog))} | {cell(_argument_notes(a))} |")
    if rows:
        lines += ["| argument | what it does | values |", "|---|---|---|", *rows, ""]
    elif not inherited:
        lines += ["No arguments.", ""]
    if inherited:
        lines += ["Also takes the [global options](#global-options) `--config FILE` and `-v`.", ""]
    if p.epilog:
        lines += [" ".join(p.epilog.split()), ""]
    for name, _, sub in _subcommands(p):
        _command_section(sub, [*path, name], global_opts, lines, level + 1)


def commands_page(p: argparse.ArgumentParser | None = None) -> str:
    """Every ``rtrl`` command and argument, walked from the argparse parser (default ``app.cli.parser()``)."""
    import app.cli as cli

    p = p or cli.parser()
    root_prog = "rtrl"
    global_opts = _options_of(p)
    lines = header("Commands", "app/cli.py (`app.cli.parser()`)")
    if p.description:
        lines += [f"`{root_prog}`: {' '.join(p.description.split())}.", ""]
    doc = inspect.cleandoc(cli.__doc__ or "")
    prose = [
        " ".join(para.split())
        for para in doc.split("\n\n")[1:]
        if para.strip() and not any(line.startswith(" ") for line in para.splitlines())
    ]
    lines += [rst_to_md(x) for para in prose for x in (para, "")]
    lines += ["| command | what it does |", "|---|---|"]
    for name, help_text, _ in _subcommands(p):
        lines.append(f"| [`{root_prog} {name}`](#{slug(f'{root_prog} {name}')}) | {cell(help_text)} |")
    lines += ["", "## Global options", "", "```", _wide_usage(p, root_prog), "```", ""]
    rows = [
        f"| {code(_argument_name(a))} | {cell(_expand_help(a, root_prog))} | {cell(_argument_notes(a))} |"
        for a in p._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
    lines += ["| option | what it does | values |", "|---|---|---|", *rows, ""]
    if p.epilog:
        lines += [" ".join(p.epilog.split()), ""]
    for name, _, sub in _subcommands(p):
        _command_section(sub, [root_prog, name], global_opts, lines, 2)
    lines += [
        "## Other entry points",
        "",
        "- `torchrun --nproc_per_node N -m trainer --config FILE` (or `python -m trainer`): the trainer job with "
        "tensor/pipeline/data parallelism from the `parallel` settings; `kafka.bootstrap` must name the cluster.",
        "- `python -m app.parts rewards|batches|serve|train [--to-end]`: one part of the loop as its own process "
        "(what `rtrl part NAME` runs).",
        "- `python -m bytewax.run flows.reward_flow:flow` and `python -m bytewax.run flows.batch_flow:flow`: the "
        "flows under Bytewax's own runner (`kafka.bootstrap` set).",
        "",
    ]
    return "\n".join(lines).rstrip("\n") + "\n"
