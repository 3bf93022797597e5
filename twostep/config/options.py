"""Every option declared once: a config dataclass's field carries its help text (`option(...)`), and
the command line's flags (`add_options`), the values back into the config (`options_from`) and the
option reference in docs/usage.md (`option_reference`, reference.py) are made from the fields, as vLLM's
EngineArgs makes its CLI from its config classes.

    python -m twostep.config > docs/usage.md     # the reference, after changing an option
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_UNSET = object()


@dataclass(frozen=True)
class Option:
    help: str
    flag: str | None = None                  # default: --the-field-name
    short: str | None = None                 # e.g. "-q"
    choices: tuple[str, ...] | None = None
    type: Callable[[str], Any] | None = None  # default: the field's default's type (int, float, str)
    metavar: str | None = None
    group: str | None = None                 # the flag's argument group in --help
    const: Any = _UNSET                      # the value of the flag given alone (nargs "?")
    negative: Any = _UNSET                   # --no-FLAG stores this value
    overlay: bool = False                    # the flag's default is None: it overrides another source


def option(default: Any, help: str, **kw) -> Any:
    """A dataclass field with its option's help and command-line form."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **kw)})


def declared(cls) -> list[tuple[dataclasses.Field, Option]]:
    """cls's fields that are options, in declaration order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def flag_of(f: dataclasses.Field, opt: Option) -> str:
    return opt.flag or "--" + f.name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, cls, dest_prefix: str = "") -> None:
    """A flag for each option of cls (dest: dest_prefix + the field's name)."""
    groups: dict[str | None, Any] = {None: parser}
    for f, opt in declared(cls):
        if opt.group not in groups:
            groups[opt.group] = parser.add_argument_group(opt.group)
        target, dest = groups[opt.group], dest_prefix + f.name
        names = [flag_of(f, opt), *([opt.short] if opt.short else [])]
        default = None if opt.overlay or f.default is dataclasses.MISSING else f.default
        kw: dict[str, Any] = {"dest": dest, "default": default, "help": opt.help}
        if _is_switch(f, opt):
            target.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
            continue
        kw["type"] = opt.type or _value_type(f)
        if opt.choices is not None:
            kw["choices"] = list(opt.choices)
        if opt.metavar is not None or opt.choices is None:
            kw["metavar"] = opt.metavar or f.name.upper()
        if opt.const is not _UNSET:
            kw.update(nargs="?", const=opt.const)
        target.add_argument(*names, **kw)
        if opt.negative is not _UNSET:
            target.add_argument("--no-" + flag_of(f, opt)[2:], dest=dest, action="store_const", const=opt.negative,
                                help=f"the same as {flag_of(f, opt)} {opt.negative}")


def options_from(args: argparse.Namespace, cls, dest_prefix: str = "") -> dict[str, Any]:
    """The options of cls as the parsed flags give them (an overlay flag only where given)."""
    values = {}
    for f, opt in declared(cls):
        value = getattr(args, dest_prefix + f.name)
        if value is not None or not opt.overlay:
            values[f.name] = value
    return values


def _is_switch(f: dataclasses.Field, opt: Option) -> bool:
    """A boolean option: --flag / --no-flag."""
    return isinstance(f.default, bool) and not opt.overlay


def _value_type(f: dataclasses.Field) -> Callable[[str], Any]:
    """int or float where the field holds one (by its default, else its annotation), else str."""
    if isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
        return type(f.default)
    first = str(f.type).split("|")[0].strip()
    return {"int": int, "float": float}.get(first, str)


def option_reference(*classes) -> str:
    """A Markdown table per class: flag, default, what it does."""
    parts = []
    for cls in classes:
        title = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
        rows = [f"### {cls.__name__}", "", title, "", "| flag | default | |", "|---|---|---|"]
        for f, opt in declared(cls):
            flags = ", ".join(f"`{n}`" for n in (flag_of(f, opt), opt.short) if n)
            if _is_switch(f, opt):
                flags = f"`{flag_of(f, opt)}` / `--no-{flag_of(f, opt)[2:]}`"
            default = "-" if f.default in (None, dataclasses.MISSING) else f"`{f.default}`"
            choices = f" ({', '.join(opt.choices)})" if opt.choices else ""
            rows.append(f"| {flags} | {default} | {opt.help.replace('|', '/')}{choices} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"
