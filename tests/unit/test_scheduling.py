"""The suite's own scheduling under pytest-xdist (tests/conftest.py): groups that hold, modules kept whole."""

import re
from pathlib import Path

from tests.conftest import XDIST_GROUPS, xdist_scope

TESTS = Path(__file__).resolve().parents[1]


def function_nodeids():
    """Every `def test_...` of the suite as the start of its node id (path::name), without collecting."""
    ids = []
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(TESTS.parent).as_posix()
        ids += [f"{rel}::{name}" for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)]
    return ids


def test_every_group_pattern_names_a_test():
    """A renamed file or test would drop out of its group silently (and then overlap what it must not)."""
    ids = function_nodeids()
    for group, patterns in XDIST_GROUPS.items():
        for pattern in patterns:
            assert any(pattern in i for i in ids), f"XDIST_GROUPS[{group!r}]: {pattern!r} matches no test"


def test_scopes():
    assert xdist_scope("tests/e2e/interop/test_vllm.py::test_bf16_export_in_bf16") == "interop"
    assert xdist_scope("tests/e2e/test_train_eagle.py::test_two_processes") == "launch"
    assert xdist_scope("tests/e2e/test_train_dflash.py::test_two_processes") == "launch"
    assert xdist_scope("tests/e2e/test_reliability.py::test_each_case_ends_in_one_clear_line_or_works[x]") == \
        "reliability"
    # e2e and integration: the module, so its module-scoped fixtures are made once
    assert xdist_scope("tests/e2e/test_train_eagle.py::test_every_family_trains[llama]") == \
        "tests/e2e/test_train_eagle.py"
    assert xdist_scope("tests/integration/test_tune.py::test_x[a::b]") == "tests/integration/test_tune.py"
    # unit tests one by one
    assert xdist_scope("tests/unit/test_docs.py::test_x[1]") == "tests/unit/test_docs.py::test_x[1]"
