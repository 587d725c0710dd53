"""serve-check says before vLLM starts what vLLM could not show here: a DFlash layout that mixes sliding and full
attention (vLLM serves it with its V2 model runner only, which needs a Triton GPU backend its CPU build lacks) and a
folder whose weights do not open. vLLM is pointed at a python that does not exist, so a check that started it would
end in that error instead of the verdict."""

from __future__ import annotations

import pytest
import torch

from draftheads.eval.interop import serve_check
from draftheads.models.dflash import DFlashConfig, build_drafter
from draftheads.models.export import export_dflash
from draftheads.models.verifier import Verifier
from tests.utils import save_tiny_verifier_with_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU serves V2")]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    return save_tiny_verifier_with_tokenizer(tmp_path_factory.mktemp("v") / "v", family="qwen3")


def dflash_export(verifier_dir, folder, **layers):
    verifier = Verifier.from_pretrained(verifier_dir)
    torch.manual_seed(0)
    cfg = DFlashConfig(num_hidden_layers=2, block_size=4, target_layer_ids=[0, 2], mask_token_id=5, **layers)
    return export_dflash(build_drafter(verifier, cfg).eval(), folder, verifier)


def serve_check_lines(verifier, draft, capsys, monkeypatch) -> tuple[int, list[str], list[str]]:
    monkeypatch.setenv("DRAFTHEADS_VLLM_PYTHON", "/nonexistent/python")
    capsys.readouterr()
    code = serve_check.main(["--verifier", str(verifier), "--draft", str(draft), "--num-prompts", "1",
                             "--max-new-tokens", "4", "-k", "3"])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err.splitlines()


def test_mixed_sliding_and_full_dflash_is_named_before_vllm(verifier, tmp_path, capsys, monkeypatch):
    folder = dflash_export(verifier, tmp_path / "mixed", layer_types=["sliding_attention", "full_attention"],
                           sliding_window=4)
    code, out, err = serve_check_lines(verifier, folder, capsys, monkeypatch)
    assert code == 1, (out, err)
    verdict = [line for line in out if line.startswith("VERDICT")]
    assert len(verdict) == 1 and "NOT JUDGED" in verdict[0] and "V2 model runner" in verdict[0], verdict
    assert "dflash.layer_types" in verdict[0] and not any("nonexistent" in line for line in err), err


def test_unreadable_weights_stop_before_vllm(verifier, tmp_path, capsys, monkeypatch):
    folder = dflash_export(verifier, tmp_path / "cut")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    code, out, err = serve_check_lines(verifier, folder, capsys, monkeypatch)
    assert code == 1, (out, err)
    verdict = [line for line in out if line.startswith("VERDICT")]
    assert len(verdict) == 1 and "NOT JUDGED" in verdict[0] and "model.safetensors" in verdict[0], verdict
    assert not any("nonexistent" in line for line in err), err


def test_a_layout_vllm_serves_here_goes_to_vllm(verifier, tmp_path, capsys, monkeypatch):
    """The control: one kind of layer is run in vLLM (here: the missing python, one line, exit 2)."""
    folder = dflash_export(verifier, tmp_path / "full")
    code, _, err = serve_check_lines(verifier, folder, capsys, monkeypatch)
    assert code == 2 and err[-1] == "error: DRAFTHEADS_VLLM_PYTHON='/nonexistent/python': no such file", err
