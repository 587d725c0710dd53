import os

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
    "launch": ("tests/test_multiprocess.py::", "tests/test_fsdp.py::", "::test_two_processes",
               "test_hidden_states.py::test_two_processes_split_the_shards"),
    "interop": ("tests/interop/",),
}


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.cuda` tests are skipped where no CUDA GPU is visible (the marker's promise in pyproject); the
    xdist groups above are attached."""
    import torch

    for item in items:
        for group, patterns in XDIST_GROUPS.items():
            if any(p in item.nodeid for p in patterns):
                item.add_marker(pytest.mark.xdist_group(group))
                break
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
