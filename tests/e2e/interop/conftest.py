"""The interop suite needs vLLM (scripts/setup_vllm.sh puts its CPU build in .venv-vllm). Without it these tests
fail, saying how to set it up, unless DRAFTHEADS_INTEROP=0 asks to leave them out (then they are skipped, saying
so): a CI run can never pass without having run them."""

import os

import pytest


@pytest.fixture(scope="session")
def vllm_ready():
    from draftheads.eval.interop.vllm_peer import VllmUnavailable, vllm_python

    if os.environ.get("DRAFTHEADS_INTEROP") == "0":
        pytest.skip("DRAFTHEADS_INTEROP=0: the vLLM interop suite is left out")
    try:
        return vllm_python()
    except VllmUnavailable as err:
        pytest.fail(str(err))
