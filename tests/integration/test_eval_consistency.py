"""draftheads.eval.measure.consistency.check_export: an export reloaded from disk decodes like the in-memory drafter (EAGLE-1, EAGLE-3,
Medusa-1, Medusa-2), and a tampered export (feature blocks of fc swapped, two Medusa heads swapped, another tree)
fails loudly."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftheads.eval.measure.consistency import ConsistencyError, check_export, prompts_from_rows
from draftheads.models.export import export_eagle, save_medusa
from draftheads.models.medusa import MedusaHeads, add_lora
from draftheads.models.verifier import Verifier
from tests.utils import fit_eagle, greedy_corpus, peaked_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 77, 31, 200, 9, 77, 31], [42, 7], [8, 8, 120, 3, 64, 19, 250, 7, 120, 3, 64]]


@pytest.fixture(scope="module")
def setup():
    model = peaked_model("llama")
    verifier = Verifier(model)
    g = torch.Generator().manual_seed(1)
    corpus = greedy_corpus(model, PROMPTS + torch.randint(3, 256, (8, 6), generator=g).tolist(), 32)
    return verifier, corpus


def fit_medusa(verifier, corpus, num_heads: int = 3) -> MedusaHeads:
    """Medusa heads that are right part of the time: head k = lm_head(M_k h_t), M_k the least-squares map from the
    verifier's h_t to h_{t+k+1} on `corpus` (whose argmax is token t+k+2 on greedy text); ResBlocks identity."""
    heads = MedusaHeads.from_verifier(verifier, num_heads=num_heads)
    hs = [verifier.features(torch.tensor([row])).final[0].double() for row in corpus]  # (T, H) each
    with torch.no_grad():
        for k in range(num_heads):
            x = torch.cat([h[: len(h) - k - 1] for h in hs])
            y = torch.cat([h[k + 1:] for h in hs])
            m = torch.linalg.lstsq(x, y, driver="gelsd").solution  # (H, H): y ~ x @ m
            heads.lm_heads[k].weight.copy_((verifier.lm_head.weight.double() @ m.T).float())
    return heads.eval()


def tamper(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_export_matches_and_tampering_fails(setup, tmp_path, version):
    verifier, corpus = setup
    drafter = fit_eagle(verifier, version, corpus, draft_vocab_size=200 if version == 3 else None)
    export_eagle(drafter, tmp_path / "drafter", verifier)
    result = check_export(drafter, tmp_path / "drafter", verifier, PROMPTS, max_new_tokens=24, depth=3, top_k=2,
                          total_tokens=6)
    assert result.method == "eagle" and result.tau_export == result.tau_in_memory > 1.2
    metrics = result.metrics()
    assert metrics["eval/tau"] == result.tau_export and "eval/accept_pos1" in metrics
    assert check_export(drafter, tmp_path / "drafter", verifier, PROMPTS, max_new_tokens=24, chain=3).tau_export > 1.2

    def reverse_feature_blocks(t):  # EAGLE-3: the layers concatenated in reverse; EAGLE-1: [f; e] for [e; f]
        t["fc.weight"] = torch.cat(t["fc.weight"].split(verifier.hidden_size, dim=1)[::-1], 1).contiguous()

    tamper(tmp_path / "drafter", reverse_feature_blocks)
    with pytest.raises(ConsistencyError, match=r"reloaded, reaches tau .* the in-memory drafter .*first differs"):
        check_export(drafter, tmp_path / "drafter", verifier, PROMPTS, max_new_tokens=24, chain=3)


def test_medusa_export_matches_its_tree(setup, tmp_path):
    verifier, corpus = setup
    heads = fit_medusa(verifier, corpus)
    tree = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    save_medusa(tmp_path / "drafter", heads, verifier, tree=tree)
    result = check_export(heads, tmp_path / "drafter", verifier, PROMPTS, max_new_tokens=24, tree=tree)
    assert result.method == "medusa" and result.tau_export == result.tau_in_memory > 1.2
    with pytest.raises(ConsistencyError):  # the trainer built another tree than the one exported
        check_export(heads, tmp_path / "drafter", verifier, PROMPTS, max_new_tokens=24, tree=[(0,)])

    def swap_heads(t):
        t["lm_heads.0.weight"], t["lm_heads.1.weight"] = t["lm_heads.1.weight"], t["lm_heads.0.weight"]

    tamper(tmp_path / "drafter", swap_heads)
    with pytest.raises(ConsistencyError, match="exported medusa drafter"):
        check_export(heads, tmp_path / "drafter", verifier, PROMPTS, max_new_tokens=24, tree=tree)


def test_medusa2_adapter_reloads(setup, tmp_path):
    """Medusa-2: heads plus a (non-zero) LoRA adapter; the export side merges the adapter into the base verifier."""
    _, corpus = setup
    verifier = Verifier(peaked_model("llama"))
    heads = fit_medusa(verifier, corpus)
    peft_model = add_lora(verifier, r=4, alpha=8, dropout=0.0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    save_medusa(tmp_path / "drafter", heads, verifier)
    result = check_export(heads, tmp_path / "drafter", verifier, PROMPTS, max_new_tokens=16)
    assert result.tau_export == result.tau_in_memory > 1.0
    assert isinstance(verifier.model, type(peft_model))  # the trainer's verifier is left as it was


def test_prompts_from_rows():
    rows = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
    assert prompts_from_rows(rows, num_prompts=2, prompt_tokens=3, pad_token_id=0) == [[5, 6, 7], [1, 2, 3]]
    expected = "MedusaHeads, an EagleDrafter, a DFlashDrafter or an MtpDrafter, got Linear"
    with pytest.raises(TypeError, match=expected):
        check_export(torch.nn.Linear(2, 2), "x", None, [[1, 2]])
