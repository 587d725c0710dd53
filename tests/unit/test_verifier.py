import json

import pytest
import torch

from draftheads.models.verifier import Verifier, VerifierError, check_drafter_matches
from tests.utils import FAMILIES, save_tiny_verifier


@pytest.mark.parametrize("family", FAMILIES)
def test_lm_head_of_final_feature_is_the_models_logits(tiny_verifier_dirs, family):
    verifier = Verifier.from_pretrained(tiny_verifier_dirs[family])
    ids = torch.randint(0, verifier.vocab_size, (2, 9))
    feats = verifier.features(ids, layer_ids=[1, 2], return_logits=True)
    with torch.no_grad():
        logits = verifier.model(ids).logits
    torch.testing.assert_close(verifier.lm_head(feats.final), logits)
    torch.testing.assert_close(feats.logits, logits)
    assert feats.final.shape == (2, 9, verifier.hidden_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_features_are_layer_inputs(tiny_verifier_dirs, family):
    """Layer i's feature is what layer i receives: HF `hidden_states[i]`, checked with an independent hook."""
    verifier = Verifier.from_pretrained(tiny_verifier_dirs[family])
    ids = torch.randint(0, verifier.vocab_size, (2, 7))
    layer_ids = [0, 2, verifier.num_layers - 1]
    seen = {}
    hooks = [verifier.layers[i].register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: seen.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).clone()),
        with_kwargs=True) for i in layer_ids]
    with torch.no_grad():
        out = verifier.model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    feats = verifier.features(ids, layer_ids=layer_ids)
    for i, feat in zip(layer_ids, feats.layers):
        torch.testing.assert_close(feat, seen[i])
        torch.testing.assert_close(feat, out.hidden_states[i])
    torch.testing.assert_close(feats.layers[0], verifier.embed_tokens(ids))
    torch.testing.assert_close(feats.final, out.hidden_states[-1])


def test_frozen_and_no_grad(llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    assert not verifier.model.training
    assert all(not p.requires_grad for p in verifier.parameters())
    feats = verifier.features(torch.randint(0, 256, (1, 5)))
    assert not feats.final.requires_grad


def test_fingerprint_is_stable_across_dtypes_and_differs_between_models(tmp_path, llama_dir):
    a = Verifier.from_pretrained(llama_dir)
    b = Verifier.from_pretrained(llama_dir, dtype="bfloat16")
    assert b.dtype == torch.bfloat16
    assert a.fingerprint == b.fingerprint
    other = Verifier.from_pretrained(save_tiny_verifier(tmp_path / "other", "llama", seed=1))
    assert other.fingerprint != a.fingerprint


def test_default_eagle3_layers_and_range_check(llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    assert verifier.default_eagle3_layers() == [1, 2, 3]  # 4 layers: vLLM's 2, L//2, L-3 would repeat layer 2
    with pytest.raises(VerifierError, match=r"\[4\] out of range.*4 layers"):
        verifier.features(torch.zeros(1, 3, dtype=torch.long), layer_ids=[1, 4])


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(VerifierError, match="does not exist"):
        Verifier.from_pretrained(tmp_path / "nope")


def test_pickle_only_verifier_is_refused(tmp_path, llama_dir):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((llama_dir / "config.json").read_text())
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(VerifierError, match=r"no \.safetensors weights \(found pytorch_model\.bin\).*never pickle"):
        Verifier.from_pretrained(folder)


def test_drafter_mismatch_names_the_field(llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    stored = verifier.describe()
    check_drafter_matches(stored, verifier, "d")
    with pytest.raises(VerifierError, match="hidden_size=128"):
        check_drafter_matches({**stored, "hidden_size": 128}, verifier, "d")
    with pytest.raises(VerifierError, match="fingerprint"):
        check_drafter_matches({**stored, "fingerprint": "0" * 16}, verifier, "d")
    json.dumps(stored)  # it is stored in config.json
