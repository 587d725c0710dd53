"""The house rules for imports, read from the source (every import statement, module level or inside a function):

  - one installed namespace: project code imports `draftheads.<room>`, never a bare top-level `data`, `models`,
    `eval` or `train` (those are folders of the checkout, linked under `draftheads/`), and nothing edits `sys.path`;
  - draftheads/data, draftheads/models, draftheads/eval and draftheads/train are relative links to the rooms, so
    the package is a plain folder tree (an editor's static import resolution reads it as Python does:
    tests/integration/test_static_imports.py);
  - the layers run one way, data -> models -> eval -> train: a module may import its own layer and the ones before
    it, never a later one (the `draftheads` command, scripts/ and tests/ sit above all and may import anything);
  - inside eval/, the engine imports no drafter, no measurement and no interop; the drafters import no
    measurement and no interop;
  - no import loop between project modules (Python may tolerate one; a reader should not have to);
  - Accelerate is imported only in train/.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "draftheads"
LAYERS = ("data", "models", "eval", "train")
#: rooms inside eval/ and the rooms each may not import
EVAL_ROOMS = {"engine": ("drafters", "measure", "interop"), "drafters": ("measure", "interop")}


def module_name(path: Path) -> str:
    """The installed name of a project file: data/x.py -> draftheads.data.x, draftheads/cli.py -> draftheads.cli."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == PACKAGE else [PACKAGE, *parts])


def project_modules() -> dict[str, Path]:
    found = {}
    for folder in (*LAYERS, PACKAGE):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[module_name(path)] = path
    return found


def layer_of(name: str) -> str | None:
    """data / models / eval / train for a project module name; None for the package root and its command."""
    parts = name.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 and parts[1] in LAYERS else None


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a project module (or a bare layer name, or accelerate),
    resolving `from pkg import sub` to the submodule when `sub` is one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            found += [(node.lineno, s) for s in subs] or [(node.lineno, base)]
    roots = set(LAYERS) | {PACKAGE, "accelerate"}
    return [(line, name) for line, name in found if name.split(".")[0] in roots]


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    modules = project_modules()
    return modules, {name: imports_of(path, modules) for name, path in modules.items()}


def where(modules, name, line) -> str:
    return f"{modules[name].relative_to(ROOT)}:{line}"


def test_project_code_imports_only_the_namespace():
    modules, edges = graph()
    wrong = [f"{where(modules, name, line)} imports {target} (expected {PACKAGE}.{target})"
             for name, imported in edges.items() for line, target in imported if target.split(".")[0] in LAYERS]
    assert not wrong, "imports outside the draftheads namespace:\n" + "\n".join(wrong)


def test_nothing_edits_sys_path():
    edit = re.compile(r"sys\.path(\.insert|\.append|\.extend|\s*\[[^\]]*\]\s*=|\s*=)")
    wrong = [f"{path.relative_to(ROOT)}:{i}" for folder in (*LAYERS, PACKAGE, "scripts", "tests")
             for path in sorted((ROOT / folder).rglob("*.py")) if path != Path(__file__).resolve()
             for i, line in enumerate(path.read_text().splitlines(), 1) if edit.search(line)]
    assert not wrong, "sys.path edits:\n" + "\n".join(wrong)


def test_layers_import_only_downwards():
    modules, edges = graph()
    wrong = []
    for name, imported in edges.items():
        layer = layer_of(name)
        if layer is None:
            continue
        rank = LAYERS.index(layer)
        for line, target in imported:
            top = layer_of(target)
            if top is not None and LAYERS.index(top) > rank:
                wrong.append(f"{where(modules, name, line)} imports {target} "
                             f"({layer}/ may import only {', '.join(LAYERS[:rank + 1])})")
    assert not wrong, "backward imports:\n" + "\n".join(wrong)


def test_the_engine_imports_no_drafter_measurement_or_interop():
    modules, edges = graph()
    wrong = []
    for name, imported in edges.items():
        room = name.split(".")[2] if name.startswith(f"{PACKAGE}.eval.") else None
        for line, target in imported:
            parts = target.split(".")
            if room in EVAL_ROOMS and parts[:2] == [PACKAGE, "eval"] and len(parts) > 2 and \
                    parts[2] in EVAL_ROOMS[room]:
                wrong.append(f"{where(modules, name, line)} imports {target} "
                             f"(eval/{room}/ imports none of {', '.join(EVAL_ROOMS[room])})")
            if room in EVAL_ROOMS and target == f"{PACKAGE}.eval":
                wrong.append(f"{where(modules, name, line)} imports {target} (the package root imports every room)")
    assert not wrong, "imports against the rooms of eval/:\n" + "\n".join(wrong)


def test_accelerate_only_in_train():
    modules, edges = graph()
    wrong = [f"{where(modules, name, line)} imports {target}"
             for name, imported in edges.items() if layer_of(name) != "train"
             for line, target in imported if target.split(".")[0] == "accelerate"]
    assert not wrong, "Accelerate outside train/:\n" + "\n".join(wrong)


def test_no_import_loops():
    modules, edges = graph()
    targets = {name: sorted({t for _, t in imported if t in modules and t != name}) for name, imported in edges.items()}
    # Tarjan's strongly connected components: any with more than one module is a loop
    index, low, stack, on_stack, loops, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in targets[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(targets):
        if v not in index:
            visit(v)
    assert not loops, "import loops:\n" + "\n".join(" <-> ".join(c) for c in loops)


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages by hand: a new folder left out would be missing
    from a wheel, so the list must equal the folders that hold an __init__.py."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(p.parent / "__init__.py") for folder in (*LAYERS, PACKAGE)
             for p in (ROOT / folder).rglob("__init__.py")}
    assert listed == found, f"pyproject.toml packages: missing {sorted(found - listed)}, extra {sorted(listed - found)}"


def test_the_rooms_are_linked_under_the_package():
    """draftheads/<room> is a relative link to the room (git keeps links): what makes `draftheads.<room>` a real
    path, for static tools, the editable install and a wheel alike. A checkout made with git's core.symlinks off
    has a small file holding the text `../data` there instead."""
    wrong = []
    for layer in LAYERS:
        link = ROOT / PACKAGE / layer
        found = (f"a link to {os.readlink(link)}" if link.is_symlink() else "a folder" if link.is_dir()
                 else "a file" if link.exists() else "nothing")
        if found != f"a link to ../{layer}":
            wrong.append(f"{PACKAGE}/{layer}: expected a link to ../{layer}, found {found}")
    assert not wrong, "the rooms under the package:\n" + "\n".join(wrong)


def test_installed_namespace_is_draftheads_alone(tmp_path):
    """From a folder outside the checkout, the layers import only under `draftheads`, from this checkout."""
    code = ("import importlib.util, json; import draftheads.eval, draftheads.train.loop; "
            "print(json.dumps({'bare': [m for m in ('data', 'models', 'eval', 'train') "
            "if importlib.util.find_spec(m) is not None], 'eval': draftheads.eval.__file__}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bare"] == [] and Path(got["eval"]).resolve() == ROOT / "eval" / "__init__.py"


def fake_tree(root: Path, monkeypatch, files: dict[str, str]) -> None:
    """A project of empty layer packages plus `files` under `root`, which the checks then read."""
    for layer in (*LAYERS, PACKAGE):
        (root / layer).mkdir()
        (root / layer / "__init__.py").write_text("")
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", root)


@pytest.mark.parametrize("source, bad", [
    ("from draftheads.train.loop import TrainLoop\n", "data/x.py:1 imports draftheads.train.loop"),
    ("def f():\n    from draftheads.eval.engine.decoder import x\n",
     "data/x.py:2 imports draftheads.eval.engine.decoder"),
])
def test_the_check_sees_backward_imports(tmp_path, monkeypatch, source, bad):
    """The rule itself: a data/ module importing eval or train (even inside a function) is reported."""
    fake_tree(tmp_path, monkeypatch, {"train/loop.py": "", "eval/engine/decoder.py": "", "data/x.py": source})
    with pytest.raises(AssertionError, match=bad.replace(".", r"\.")):
        test_layers_import_only_downwards()


def test_the_check_sees_an_engine_importing_a_drafter(tmp_path, monkeypatch):
    fake_tree(tmp_path, monkeypatch, {"eval/drafters/eagle.py": "", "eval/engine/loop.py":
                                      "def f():\n    from draftheads.eval.drafters import eagle\n"})
    with pytest.raises(AssertionError, match=r"eval/engine/loop\.py:2 imports draftheads\.eval\.drafters\.eagle"):
        test_the_engine_imports_no_drafter_measurement_or_interop()


def test_the_check_sees_bare_layer_imports_and_path_edits(tmp_path, monkeypatch):
    fake_tree(tmp_path, monkeypatch, {"eval/x.py": "import sys\nsys.path.insert(0, '.')\nfrom models.y import z\n"})
    with pytest.raises(AssertionError, match=r"eval/x\.py:3 imports models\.y"):
        test_project_code_imports_only_the_namespace()
    with pytest.raises(AssertionError, match=r"eval/x\.py:2"):
        test_nothing_edits_sys_path()


def test_the_check_sees_a_room_that_is_no_link(tmp_path, monkeypatch):
    fake_tree(tmp_path, monkeypatch, {})
    (tmp_path / PACKAGE / "data").write_text("../data")  # git's core.symlinks off
    for layer in ("models", "eval"):
        (tmp_path / PACKAGE / layer).symlink_to(f"../{layer}")
    (tmp_path / PACKAGE / "train").symlink_to(tmp_path / "train")  # absolute: breaks when the checkout moves
    with pytest.raises(AssertionError) as failed:
        test_the_rooms_are_linked_under_the_package()
    lines = [line.strip() for line in str(failed.value).splitlines()]
    assert "draftheads/data: expected a link to ../data, found a file" in lines
    assert f"draftheads/train: expected a link to ../train, found a link to {tmp_path / 'train'}" in lines
    assert not any(line.startswith(("draftheads/models", "draftheads/eval")) for line in lines)


def test_the_check_sees_loops(tmp_path, monkeypatch):
    fake_tree(tmp_path, monkeypatch, {"eval/a.py": "from draftheads.eval.b import x\n",
                                      "eval/b.py": "def f():\n    from draftheads.eval import a\n"})
    with pytest.raises(AssertionError, match=r"draftheads\.eval\.a <-> draftheads\.eval\.b"):
        test_no_import_loops()
