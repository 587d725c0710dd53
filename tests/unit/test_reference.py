"""docs/reference.md is what the code says: regenerated here and compared, every config key documented, and the
keys and defaults the page lists are the ones the trainers' parser accepts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from draftheads import reference

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference.md"


def test_the_page_is_current():
    expected = reference.page()
    got = PAGE.read_text() if PAGE.is_file() else ""
    if got != expected:
        pytest.fail(f"docs/reference.md differs from the code: rewrite it with `{reference.COMMAND}`", pytrace=False)
    assert got.splitlines()[0].startswith("*Generated from the code by `python -m draftheads.reference")


def test_every_config_key_has_a_docstring():
    missing = reference.undocumented()
    assert not missing, ("config fields without a docstring (one line under the field: what the key is, its unit): "
                         + ", ".join(missing))


@dataclass
class _Inner:
    """A section."""

    size: int = 1
    """Documented."""


@dataclass
class _Base:
    kept: int = 0
    """Documented in the base."""
    bare: float = 0.5


@dataclass
class _Run(_Base):
    kept: int = 2
    inner: _Inner = field(default_factory=_Inner)
    loose: _Inner = field(default_factory=_Inner)
    """Documented section field."""


def test_the_docstring_check_sees_a_missing_one():
    """A field with no string under it is reported, in the base or in a subclass, a section field too; a field
    redeclared without one in a subclass is reported against the subclass (its docstring is the first in the MRO)."""
    missing = reference.undocumented([_Run])
    here = f"{__name__}."
    assert missing == [f"{here}_Run.kept", f"{here}_Base.bare", f"{here}_Run.inner"]
    keys, sections = reference.walk(_Run)
    assert [k.path for k in keys] == ["kept", "bare", "inner.size", "loose.size"]
    assert [s.path for s in sections] == ["inner", "loose"]


def test_keys_and_defaults_are_the_parsers():
    """Each trainer's keys, as jsonargparse builds its command line from the same class, and their defaults."""
    from draftheads.train.config import _build_parser

    for name, (cls, _) in reference.trainers().items():
        parser = _build_parser(cls, f"draftheads train {name}")
        keys, sections = reference.walk(cls)
        options = {a.option_strings[0][2:] for a in parser._actions if a.option_strings[0].startswith("--")}
        assert options - {"help", "config", "print_config"} == {k.path for k in keys} | {s.path for s in sections}, \
            name
        defaults = parser.get_defaults()
        for key in keys:
            got = defaults[key.path]
            assert got == key.default and type(got) is type(key.default), (name, key.path, got, key.default)


def test_every_verb_is_on_the_page():
    from draftheads.cli import VERBS

    text = reference.page()
    assert [verb for verb in VERBS if f"\n### draftheads {verb}\n" not in text] == []


def test_the_page_holds_nothing_of_this_machine():
    text = reference.page()
    assert str(ROOT) not in text and str(Path.home()) not in text and " at 0x" not in text


@pytest.mark.parametrize("text, cell", [
    ("a | b", r"a \| b"),
    ("`x | y` or z", r"`x \| y` or z"),
    ("decay**k of <name>", r"decay\*\*k of \<name>"),
    ("`a*b <c>`", "`a*b <c>`"),
])
def test_cells_escape_markup(text, cell):
    assert reference.text_cell(text) == cell


def test_values_are_written_as_in_yaml():
    assert [reference.yaml_text(v) for v in (None, True, (0.9, 0.95), "runs/eagle", "", 1e-3)] == \
        ["null", "true", "[0.9, 0.95]", "runs/eagle", "''", "0.001"]
    assert reference.code("int | None") == r"`int \| None`"
