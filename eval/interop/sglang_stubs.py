"""Stand-in modules for the SGLang loader check (eval/interop/sglang_runner.py, run in .venv-sglang; imports nothing of
ours): packages that cannot be installed on a CPU-only machine.

Any `import <pkg>` or `import <pkg>.<sub>...` for a package in STUBBED resolves to
an empty module whose every attribute is a _Stub. A _Stub used as a decorator
returns the decorated object unchanged; anything else it does returns another
_Stub. Every use after `mark_imports_done()` is logged in LATE_USES, so a check
can prove the stubs were not touched while building / loading the model.
"""
import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = set()  # whole package trees
EXACT = set()  # single modules (their parents must be stubbed or exact too)
LATE_USES = []
_imports_done = [False]


def mark_imports_done():
    _imports_done[0] = True


def _importing():
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.startswith("<frozen importlib"):
            return True
        f = f.f_back
    return False


def _note(what):
    # Uses while a module body runs (import time) are expected and not logged.
    if _imports_done[0] and not _importing():
        LATE_USES.append(what)


class _Stub:
    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        _note(f"{self._name}.{attr}")
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        _note(f"{self._name}()")
        if len(args) == 1 and not kwargs and (callable(args[0]) or isinstance(args[0], type)):
            return args[0]  # used as a decorator
        return _Stub(f"{self._name}()")

    def __getitem__(self, key):
        return _Stub(f"{self._name}[]")

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())

    def __repr__(self):
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        _note(f"{self.__name__}.{attr}")
        return _Stub(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED or fullname in EXACT:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0"
        return m

    def exec_module(self, module):
        pass


def install(trees=(), exact=()):
    STUBBED.update(trees)
    EXACT.update(exact)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
