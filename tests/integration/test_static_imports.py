"""Project imports resolve for a static tool from a checkout, as they do at run time.

An editor's "go to definition" (jedi here; pyright reads the tree the same way) does not run setuptools' import
hook, so `draftheads.<room>` must be a real path in the checkout: draftheads/data, draftheads/models,
draftheads/eval and draftheads/train are links to the rooms (pyproject.toml says why). jedi reads the checkout
for project names and the environment's own library folders for third-party ones, nothing installed for
draftheads: the editable install's finder plays no part.

The sample: evenly spaced `from draftheads... import ...` statements of every folder that holds project code, each
imported name asked of jedi and required to land on the file that defines it, found independently by reading the
source (a name a module imports from another project module is defined where that one defines it).
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path

import pytest

from tests.unit.test_imports import LAYERS, PACKAGE, ROOT, module_name, project_modules

#: folders whose modules import the project, and how many import statements of each the sample takes
SOURCES = {"data": 4, "models": 6, "eval": 6, "train": 6, PACKAGE: 3, "scripts": 5, "tests": 6}


@functools.cache
def tree_of(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def package_of(path: Path) -> str:
    """The package a relative import in `path` is relative to (scripts/ and tests/ use absolute imports only)."""
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def absolute(node: ast.ImportFrom, path: Path) -> str:
    if not node.level:
        return node.module or ""
    anchor = package_of(path).split(".")
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def top_level_statements(tree: ast.Module):
    """Module-level statements, including those under `if`/`try` (a name bound there is still the module's)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]


def defined_in(module: str, name: str, modules: dict[str, Path], seen=()) -> Path | None:
    """The project file that defines `module`'s `name` (a submodule's own file; following project re-exports), or
    None when the name is not the project's (a third-party name re-exported)."""
    if f"{module}.{name}" in modules:
        return modules[f"{module}.{name}"]
    path = modules.get(module)
    if path is None or (module, name) in seen:
        return None
    for node in top_level_statements(tree_of(path)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return defined_in(absolute(node, path), alias.name, modules, (*seen, (module, name)))
        elif isinstance(node, ast.Import):
            if any((a.asname or a.name.partition(".")[0]) == name for a in node.names):
                return None
    return path  # a def, class or assignment of this module (jedi finds which)


def sample(modules: dict[str, Path]) -> list[tuple[Path, ast.ImportFrom]]:
    """Evenly spaced `from draftheads.X import ...` statements of each folder in SOURCES, in file order."""
    picked = []
    for folder, count in SOURCES.items():
        found = []
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [(path, node) for node in ast.walk(tree_of(path)) if isinstance(node, ast.ImportFrom)
                      and not node.level and (node.module or "").startswith(f"{PACKAGE}.")
                      and all(defined_in(node.module, a.name, modules) for a in node.names)]
        found.sort(key=lambda item: (item[0], item[1].lineno))
        assert len(found) >= count, f"{folder}/ has {len(found)} project imports; the sample wants {count}"
        picked += [found[i * len(found) // count] for i in range(count)]
    return picked


def jedi_project(jedi):
    """The checkout (jedi puts the project folder first) and this environment's library folders for third-party
    names: no sys.path of this process (pytest's or a .pth file's additions), no import hook."""
    paths = dict.fromkeys(sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    return jedi.Project(path=ROOT, sys_path=[p for p in paths if p], smart_sys_path=True)


def shown(path) -> str:
    """A definition's file as the repository names it (links resolved), or as it is when outside the checkout."""
    if path is None:
        return "a builtin"
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def test_jedi_resolves_project_imports_from_a_checkout(tmp_path, monkeypatch):
    try:
        import jedi
    except ImportError:
        pytest.fail("jedi is not installed: it is a dev extra (pip install -e '.[dev]')")
    monkeypatch.setattr(jedi.settings, "cache_directory", str(tmp_path))  # a cold start, as in CI; nothing in ~/.cache
    modules = project_modules()
    project, environment = jedi_project(jedi), jedi.InterpreterEnvironment()
    lines, wrong = sample(modules), []
    rooms = {node.module.split(".")[1] for _, node in lines}
    assert set(LAYERS) <= rooms and len(lines) >= 30, f"the sample covers {sorted(rooms)} in {len(lines)} lines"
    scripts = {}
    for path, node in lines:
        script = scripts.setdefault(path, jedi.Script(path=path, project=project, environment=environment))
        for alias in node.names:  # the cursor on the imported name (import lines are ASCII: bytes = characters)
            expected = defined_in(node.module, alias.name, modules).resolve()
            found = script.goto(alias.lineno, alias.col_offset, follow_imports=True)
            got = sorted(shown(d.module_path) for d in found)
            if got != [shown(expected)]:
                wrong.append(f"{path.relative_to(ROOT)}:{alias.lineno} `from {node.module} import {alias.name}`: "
                             f"jedi found {', '.join(got) or 'nothing'}, expected {shown(expected)}")
    assert not wrong, f"{len(wrong)} imported names jedi does not resolve from the checkout:\n" + "\n".join(wrong)
