"""The reference page, docs/reference.md, generated from the code: every config key of every trainer (type, default,
docstring) and every flag of every `draftheads` verb (type or choices, default, help).

    python -m draftheads.reference --write     # rewrite docs/reference.md in this checkout
    python -m draftheads.reference             # print the page

What it reads, so the page follows the code without a list of its own:
  - the trainers are `draftheads.cli.TRAINERS`, each one's root config class `draftheads.cli.trainer(name)[0]`; its
    keys are the dataclass fields, walked as jsonargparse walks them (a field whose type is a dataclass is a
    section: `--section.key=value`, `section:` in the YAML), in declaration order;
  - a field's text is its attribute docstring (the string literal right under the field), read from the source's
    syntax tree along the class's MRO, the first class that declares the field winning; a field without one is an
    error, so every key is documented;
  - the verbs are `draftheads.cli.VERBS`; each verb's module exposes `parser()`, the argparse parser its `main`
    parses with (`build-verifier` runs the embedded verifier's `build` subcommand; `train` takes the config keys).

The output depends only on the code: no paths of this machine, no terminal width, no time. tests/unit/
test_reference.py regenerates it and compares.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path

COMMAND = "python -m draftheads.reference --write"
#: where --write puts the page: docs/ of the checkout this package is in
PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
#: verbs whose work is a function of draftheads/cli.py rather than a module's main: (module, subcommand)
SUBCOMMAND_VERBS = {"build-verifier": ("draftheads.models.tiny.cli", "build")}


class ReferenceError(ValueError):
    """The code cannot be documented as it stands (an undocumented key, a verb without a parser); says what to fix."""


# ---- config keys ---------------------------------------------------------------------------------------------------
@dataclass
class Key:
    """One config key: `section` is its dotted section ("" at the top level)."""

    section: str
    name: str
    type: str
    default: object
    doc: str | None
    owner: str
    """module.Class that declares the field (where a missing docstring goes)."""

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    def row(self) -> tuple[str, str, str, str]:
        return (code(self.path), code(self.type), code(yaml_text(self.default)), text_cell(self.doc or ""))


@dataclass
class Section:
    """A dataclass-typed field: its keys are `--path.key`."""

    path: str
    doc: str
    """The section class's docstring (the field's when the class has none)."""
    field_doc: str | None
    owner: str


def trainers() -> dict[str, tuple[type, str]]:
    """{trainer: (its root config class, the module that runs it)}, as `draftheads train` resolves them."""
    from draftheads import cli

    out = {}
    for name in cli.TRAINERS:
        cls, main = cli.trainer(name)
        out[name] = (cls, main.__module__)
    return out


@functools.cache
def class_node(cls: type) -> ast.ClassDef:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError) as err:
        raise ReferenceError(f"{qualified(cls)}: its source cannot be read ({err}), so its fields' docstrings "
                             "cannot either") from None
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef), qualified(cls)
    return node


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def class_doc(cls: type) -> str:
    """The class's own docstring (not the signature dataclass writes into __doc__ when there is none)."""
    return ast.get_docstring(class_node(cls)) or ""


def field_docs(cls: type) -> dict[str, tuple[str | None, str]]:
    """{field: (its attribute docstring or None, the class declaring it)} along the MRO, most derived first."""
    out: dict[str, tuple[str | None, str]] = {}
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        body = class_node(klass).body
        for i, node in enumerate(body):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            after = body[i + 1] if i + 1 < len(body) else None
            doc = None
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                    isinstance(after.value.value, str):
                doc = inspect.cleandoc(after.value.value)
            out.setdefault(node.target.id, (doc, qualified(klass)))
    return out


def walk(cls: type, section: str = "") -> tuple[list[Key], list[Section]]:
    """The keys and sections of a config class, in declaration order, sections recursively."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    keys, sections = [], []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kind = hints[f.name]
        doc, owner = docs.get(f.name, (None, qualified(cls)))
        path = f"{section}.{f.name}" if section else f.name
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            sections.append(Section(path, one_paragraph(class_doc(kind) or doc or ""), doc, owner))
            inner_keys, inner_sections = walk(kind, path)
            keys += inner_keys
            sections += inner_sections
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        keys.append(Key(section, f.name, type_text(kind), default, one_paragraph(doc) if doc else None, owner))
    return keys, sections


def undocumented(classes: typing.Iterable[type] | None = None) -> list[str]:
    """`module.Class.field` for every config key without a docstring (every trainer's, when no classes are given)."""
    classes = [cls for cls, _ in trainers().values()] if classes is None else list(classes)
    missing = {}  # a dict keeps the order and drops a class's fields seen through a second trainer
    for cls in classes:
        keys, sections = walk(cls)
        missing.update({f"{k.owner}.{k.name}": None for k in keys if not k.doc})
        missing.update({f"{s.owner}.{s.path.rpartition('.')[2]}": None for s in sections if not s.field_doc})
    return list(missing)


def type_text(kind) -> str:
    """A type as a YAML writer reads it: `int | null`, `list[int]`, a Literal as its values (`adamw | muon`)."""
    if kind is type(None):
        return "null"
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        return " | ".join(yaml_text(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_text(a) for a in args)}]"
    return kind.__name__ if isinstance(kind, type) else str(kind)


def yaml_text(value) -> str:
    """A value as it is written in the YAML (and after `--key=` on the command line)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value and value.strip() == value and re.fullmatch(r"[\w./:~+()-][\w ./:~+()-]*", value) \
            else repr(value)
    return repr(value)


# ---- verbs ---------------------------------------------------------------------------------------------------------
def verb_parser(verb: str, module: str | None) -> argparse.ArgumentParser | None:
    """The parser a verb's main parses with; None for `train` (its flags are the trainers' config keys)."""
    if verb == "train":
        return None
    if module is None:
        if verb not in SUBCOMMAND_VERBS:
            raise ReferenceError(f"verb {verb!r} runs a function of draftheads/cli.py; name the module and "
                                 "subcommand whose parser it uses in draftheads/reference.py SUBCOMMAND_VERBS")
        module, sub = SUBCOMMAND_VERBS[verb]
        return subparsers(load_parser(verb, module))[sub][0]
    return load_parser(verb, module)


def load_parser(verb: str, module: str) -> argparse.ArgumentParser:
    make = getattr(importlib.import_module(module), "parser", None)
    if make is None:
        raise ReferenceError(f"{module} (verb {verb!r}) has no parser(): each verb's module exposes the argparse "
                             "parser its main uses, so the reference can list its flags")
    return make()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """{subcommand: (its parser, its help)} in declaration order."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out.update({name: (sub, helps.get(name, "")) for name, sub in action.choices.items()})
    return out


def flag_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)) or \
                a.help == argparse.SUPPRESS:
            continue
        if a.option_strings:
            flag = ", ".join(a.option_strings) + (f" {a.metavar}" if a.metavar and a.nargs != 0 else "")
        else:
            flag = a.metavar or a.dest.upper()
        rows.append((code(flag), value_text(a), default_text(a), text_cell(help_text(a, parser.prog))))
    return rows


def value_text(a: argparse.Action) -> str:
    if a.nargs == 0:
        return "switch"
    kind = code(" | ".join(map(str, a.choices))) if a.choices else getattr(a.type, "__name__", "str")
    more = {"+": ", one or more", "*": ", zero or more", "?": ", optional"}.get(a.nargs, "")
    if isinstance(a, argparse._AppendAction):
        more += ", repeatable"
    return kind + more


def default_text(a: argparse.Action) -> str:
    if a.required:
        return "required"
    if a.nargs == 0:
        return ""
    if a.default is None or a.default == [] or a.default == argparse.SUPPRESS:
        return ""
    return code(yaml_text(a.default))


def help_text(a: argparse.Action, prog: str) -> str:
    text = a.help or ""
    if "%" in text:  # argparse's own expansion: %(default)s, %(prog)s, %%
        text = text % {**vars(a), "prog": prog}
    return one_paragraph(text)


# ---- markdown ------------------------------------------------------------------------------------------------------
def one_paragraph(text: str) -> str:
    return " ".join(text.split())


def code(text: str) -> str:
    """A code span for a table cell (`|` escaped: GitHub splits cells on it even inside code)."""
    ticks = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{ticks}{pad}{text.replace('|', chr(92) + '|')}{pad}{ticks}"


def text_cell(text: str) -> str:
    """Prose for a table cell: `|` escaped everywhere, and outside code spans the characters markdown would read as
    markup (`*` emphasis, `<` an HTML tag, a backslash)."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part.replace("|", "\\|"))
        else:
            out.append(re.sub(r"([\\*<|])", r"\\\1", part))
    return "".join(out)


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows), ""]


# ---- the page ------------------------------------------------------------------------------------------------------
KEY_HEADER = ("key", "type", "default", "meaning")


def key_tables(keys: list[Key], sections: dict[str, Section], title: str) -> list[str]:
    """One table per section (top level first, then the sections in declaration order)."""
    lines = []
    order = ["", *sections]
    for section in order:
        rows = [k for k in keys if k.section == section]
        if not rows:
            continue
        if section:
            lines += [f"### {title}`{section}` section", "",
                      f"`--{section}.KEY=VALUE`; in the YAML, under `{section}:`. " + text_cell(sections[section].doc),
                      ""]
        else:
            lines += [f"### {title}top-level keys", "", "`--KEY=VALUE`; in the YAML, at the top level.", ""]
        lines += table(KEY_HEADER, [k.row() for k in rows])
    return lines


def config_part() -> list[str]:
    found = trainers()
    walked = {name: walk(cls) for name, (cls, _) in found.items()}
    missing = undocumented(cls for cls, _ in found.values())
    if missing:
        raise ReferenceError(f"config keys without a docstring: {', '.join(missing)}; add one line under each field "
                             "saying what the key is and its unit")
    rows = {name: {(k.path, k.row()) for k in keys} for name, (keys, _) in walked.items()}
    first = next(iter(walked))
    common = [k for k in walked[first][0] if all((k.path, k.row()) in r for r in rows.values())]
    common_paths = {k.path for k in common}
    sections = {name: {s.path: s for s in secs} for name, (_, secs) in walked.items()}
    lines = ["## Trainer config keys", "",
             "A trainer reads a YAML file (`--config FILE.yaml`), then the command line's overrides: key `KEY` of "
             "section `SECTION` is `--SECTION.KEY=VALUE` on the command line and `KEY: VALUE` under `SECTION:` in "
             "the YAML. Types are checked and unknown keys refused, naming the key; `null` is no value. The resolved "
             "config is saved as `config.yaml` in the run folder. `draftheads dump-features` reads the same keys.",
             "", "## Every trainer", "",
             f"The keys that {', '.join(list(found)[:-1])} and {list(found)[-1]} all read, with the same type, "
             "default and meaning.", ""]
    lines += key_tables(common, sections[first], "")
    for name, (cls, module) in found.items():
        own = [k for k in walked[name][0] if k.path not in common_paths]
        lines += [f"## {name}", "", text_cell(one_paragraph(class_doc(cls))) + " "
                  f"`draftheads train {name} ...`, or `accelerate launch -m {module} ...` for several processes. It "
                  "reads the keys of [every trainer](#every-trainer) and these.", ""]
        lines += key_tables(own, sections[name], f"{name}: ")
    return lines


def verbs_part() -> list[str]:
    from draftheads import cli

    lines = ["## Command-line verbs", "",
             "Each verb prints its flags with `--help` (`draftheads eval --help`); here they are for every verb, in "
             "the order `draftheads --help` lists the verbs.", ""]
    for verb, (overview, module) in cli.VERBS.items():
        parser = verb_parser(verb, module)
        lines += [f"### draftheads {verb}", ""]
        if parser is None:
            lines += [f"Trains a drafter: the trainer comes first ({', '.join(cli.TRAINERS)}), then "
                      "`--config FILE.yaml` and any key of [its config](#trainer-config-keys) as "
                      "`--SECTION.KEY=VALUE`, e.g. `draftheads train eagle --config configs/eagle3-tiny.yaml "
                      "--train.max_steps=50`.", ""]
            continue
        lines += [text_cell(one_paragraph(overview)), ""]
        lines += parser_tables(parser, f"draftheads {verb}")
    return lines


FLAG_HEADER = ("flag", "value", "default", "meaning")


def parser_tables(parser: argparse.ArgumentParser, name: str) -> list[str]:
    lines = []
    rows = flag_rows(parser)
    if rows:
        lines += table(FLAG_HEADER, rows)
    for sub, (subparser, help_) in subparsers(parser).items():
        lines += [f"`{name} {sub}`: {text_cell(one_paragraph(help_))}", ""]
        lines += table(FLAG_HEADER, flag_rows(subparser)) if flag_rows(subparser) else []
    if parser.epilog:
        lines += [text_cell(one_paragraph(parser.epilog)), ""]
    return lines


def page() -> str:
    """The whole page, as docs/reference.md holds it."""
    from draftheads import cli

    head = [f"*Generated from the code by `{COMMAND}`: edit the config dataclasses' field docstrings and the verbs' "
            "help texts, not this page (tests/unit/test_reference.py compares them).*", "",
            "# Reference", "",
            "Every config key of every trainer, with its type, default and meaning, and every flag of every "
            "`draftheads` verb.", "",
            "- [Trainer config keys](#trainer-config-keys): [every trainer](#every-trainer), "
            + ", ".join(f"[{name}](#{name})" for name in cli.TRAINERS),
            "- [Command-line verbs](#command-line-verbs): "
            + ", ".join(f"[{verb}](#draftheads-{verb})" for verb in cli.VERBS), ""]
    lines = head + config_part() + verbs_part()
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftheads.reference", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="write docs/reference.md of this checkout (default: print)")
    args = p.parse_args(argv)
    try:
        text = page()
    except ReferenceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if not args.write:
        sys.stdout.write(text)
        return 0
    if not PAGE.parent.is_dir():
        print(f"error: {PAGE.parent} is not there: --write rewrites docs/reference.md of a checkout (this package is "
              "installed elsewhere); print the page instead", file=sys.stderr)
        return 1
    from draftheads.models.atomic import write_text

    write_text(PAGE, text)
    print(f"wrote {PAGE} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
