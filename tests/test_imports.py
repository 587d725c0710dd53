"""The house rules for imports, read from the source (every import statement, module level or inside a function):

  - the layers run one way, data -> models -> eval -> train: a module may import its own layer and the ones before
    it, never a later one (scripts/ and tests/ sit above all and may import anything);
  - no import loop between project modules (Python may tolerate one; a reader should not have to);
  - Accelerate is imported only in train/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("data", "models", "eval", "train")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a module under one of LAYERS (or accelerate), resolving
    `from pkg import sub` to the submodule when `sub` is one."""
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
    roots = set(LAYERS) | {"accelerate"}
    return [(line, name) for line, name in found if name.split(".")[0] in roots]


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    modules = project_modules()
    return modules, {name: imports_of(path, modules) for name, path in modules.items()}


def test_layers_import_only_downwards():
    modules, edges = graph()
    wrong = []
    for name, imported in edges.items():
        rank = LAYERS.index(name.split(".")[0])
        for line, target in imported:
            top = target.split(".")[0]
            if top in LAYERS and LAYERS.index(top) > rank:
                wrong.append(f"{modules[name].relative_to(ROOT)}:{line} imports {target} "
                             f"({name.split('.')[0]}/ may import only {', '.join(LAYERS[:rank + 1])})")
    assert not wrong, "backward imports:\n" + "\n".join(wrong)


def test_accelerate_only_in_train():
    modules, edges = graph()
    wrong = [f"{modules[name].relative_to(ROOT)}:{line} imports {target}"
             for name, imported in edges.items() if not name.startswith("train")
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


def fake_tree(root: Path, monkeypatch, files: dict[str, str]) -> None:
    """A project of empty layer packages plus `files` under `root`, which the checks then read."""
    for layer in LAYERS:
        (root / layer).mkdir()
        (root / layer / "__init__.py").write_text("")
    for name, source in files.items():
        (root / name).write_text(source)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", root)


@pytest.mark.parametrize("source, bad", [
    ("from train.loop import TrainLoop\n", "data/x.py:1 imports train.loop"),
    ("def f():\n    from eval.decoder import make_drafter\n", "data/x.py:2 imports eval.decoder"),
])
def test_the_check_sees_backward_imports(tmp_path, monkeypatch, source, bad):
    """The rule itself: a data/ module importing eval or train (even inside a function) is reported."""
    fake_tree(tmp_path, monkeypatch, {"train/loop.py": "", "eval/decoder.py": "", "data/x.py": source})
    with pytest.raises(AssertionError, match=bad.replace(".", r"\.")):
        test_layers_import_only_downwards()


def test_the_check_sees_loops(tmp_path, monkeypatch):
    fake_tree(tmp_path, monkeypatch, {"eval/a.py": "from eval.b import x\n",
                                      "eval/b.py": "def f():\n    from eval import a\n"})
    with pytest.raises(AssertionError, match="eval.a <-> eval.b"):
        test_no_import_loops()
