import os
import time
from pathlib import Path

import pytest

# Tests never reach the hub, and run quietly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DRAFTHEADS_QUIET", "1")
# Tiny models: one intra-op thread per process is faster than two OpenMP threads spinning against each other
# (and against subprocesses such as `accelerate launch`, which inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.utils import FAMILIES, save_tiny_verifier  # noqa: E402


def pytest_sessionstart(session):
    """What tests import lazily, imported once up front: a unit test's CPU budget is its own work, not a first
    import of transformers' model classes or of the trainers. Only where tests run: not in pytest-xdist's
    controller, which hands them to its workers."""
    config = session.config
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    from transformers.models import llama, mistral, qwen2  # noqa: F401

    import draftheads.eval  # noqa: F401
    import draftheads.eval.measure.harness  # noqa: F401
    import draftheads.models.export  # noqa: F401
    import draftheads.train.eagle  # noqa: F401
    import draftheads.train.medusa  # noqa: F401


@pytest.fixture(scope="session")
def tiny_verifier_dirs(tmp_path_factory):
    """One random tiny verifier folder per family: {family: path}."""
    root = tmp_path_factory.mktemp("verifiers")
    return {family: save_tiny_verifier(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def llama_dir(tiny_verifier_dirs):
    return tiny_verifier_dirs["llama"]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a busy 2-core machine: one intra-op thread. With two, OpenMP threads spin against each
    other and against other processes, and small matmuls get 10-100x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: Under pytest-xdist (`bash scripts/test.sh` runs two workers, `--dist loadgroup`), tests that must not run beside
#: each other share a group, which one worker runs in order: multi-process launches (accelerate launch and torchrun
#: take the default rendezvous port 29500) and the real engines (one vLLM set-up for the whole interop suite).
XDIST_GROUPS = {
    "launch": ("/test_multiprocess.py::", "/test_fsdp.py::", "/test_deepspeed.py::", "::test_two_processes",
               "test_hidden_states.py::test_two_processes_split_the_shards"),
    "interop": ("tests/e2e/interop/",),
    "reliability": ("test_reliability.py::",),  # one module-scoped catalogue, built once, not once per worker
}


def xdist_scope(nodeid: str) -> str:
    """The unit of work a test is scheduled in: its group in XDIST_GROUPS; else, for an e2e or integration test, its
    module (a module-scoped fixture such as a trained drafter or a built verifier is made once, on one worker, not on
    both); a unit test alone (the finest balance)."""
    for group, patterns in XDIST_GROUPS.items():
        if any(p in nodeid for p in patterns):
            return group
    module = nodeid.split("::", 1)[0]
    return nodeid if module.startswith("tests/unit/") else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` scheduled by `xdist_scope`. Not xdist's own loadgroup: it reads groups from a suffix it
    writes into each nodeid, which pytest 9.2's node ids no longer take (pytest-xdist#1386): every group was silently
    split across workers. Work units go out largest first (xdist's order, by number of tests): the groups and the
    modules start early, and unit tests, one by one, fill the end."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    assert hasattr(LoadScopeScheduling, "_split_scope"), "pytest-xdist changed: tests/conftest.py schedules no more"

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return GroupScheduling(config, log)


#: The tiers, by folder: tests/unit/ (the quick loop), tests/integration/ (in-process runs), tests/e2e/ (launchers,
#: faults, builds, families, the real engines). A unit or integration test that spends more CPU time than its
#: tier allows fails, naming the tier: move it up a tier, or make it cheaper. CPU time of this process (not wall
#: time) so that a loaded machine does not fail a test; fixtures' set-up is not counted.
TIER_CPU_LIMIT_S = {"unit": 2.0, "integration": 10.0, "e2e": None}


def tier_of(path) -> str | None:
    parts = Path(str(path)).resolve().relative_to(Path(__file__).resolve().parent).parts
    return parts[0] if parts and parts[0] in TIER_CPU_LIMIT_S else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = time.process_time()
    yield
    item.cpu_seconds = time.process_time() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    tier = tier_of(item.path)
    limit = TIER_CPU_LIMIT_S.get(tier) if tier else None
    spent = getattr(item, "cpu_seconds", None)
    if call.when == "call" and report.passed and limit is not None and spent is not None and spent > limit:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} spent {spent:.1f} s of CPU; a {tier} test may spend {limit:.0f} s "
                           f"(tests/conftest.py TIER_CPU_LIMIT_S): move it to a higher tier or make it cheaper")


def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker (`-m unit` runs the quick loop); `@pytest.mark.cuda` tests are skipped where
    no CUDA GPU is visible (the marker's promise in pyproject)."""
    import torch

    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def fresh_accelerate():
    """Accelerate's singletons reset before and after the test (trainers build their own Accelerator)."""
    from tests.utils import reset_accelerate

    reset_accelerate()
    yield
    reset_accelerate()
