"""Medusa export (vLLM layout), reload, verifier checks, and the Medusa-2 LoRA adapter."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftheads.models.export import DrafterFormatError, load_medusa, load_medusa_verifier, save_medusa
from draftheads.models.medusa import MedusaHeads, MedusaJoint, add_lora, build_medusa_tree, lora_model
from draftheads.models.verifier import Verifier, VerifierError
from tests.medusa_reference import medusa2_loss
from tests.utils import FAMILIES, save_tiny_verifier


def _trained_heads(verifier, num_heads=3, num_layers=2, bias=True, seed=0):
    """Heads with every weight moved off its initial value, so a reload that drops anything shows."""
    heads = MedusaHeads.from_verifier(verifier, num_heads, num_layers, bias)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return heads


@pytest.mark.parametrize("family", FAMILIES)
def test_export_has_vllm_names_shapes_and_fields(tmp_path, tiny_verifier_dirs, family):
    verifier = Verifier.from_pretrained(tiny_verifier_dirs[family])
    H, V = verifier.hidden_size, verifier.vocab_size
    heads = _trained_heads(verifier)
    tree = build_medusa_tree([[0.6, 0.2], [0.4, 0.2], [0.3, 0.1]], 8)
    save_medusa(tmp_path / "drafter", heads, verifier, tree=tree, training_summary={"steps": 7},
                rank_accuracy=[[0.6, 0.2], [0.4, 0.2], [0.3, 0.1]])

    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["hidden_size"], config["vocab_size"]) == (H, V)
    assert (config["num_heads"], config["num_hidden_layers"], config["medusa_fc_bias"]) == (3, 2, True)
    # vLLM's MedusaConfig.from_pretrained renames every top-level key with "num" + "heads"/"layers" in it
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    meta = config["draftheads"]
    assert meta["method"] == "medusa" and meta["verifier"]["fingerprint"] == verifier.fingerprint
    assert meta["tree"] == [list(p) for p in tree] and meta["training"] == {"steps": 7}
    assert meta["adapter"] is None

    tensors = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    expected = {}
    for h in range(3):
        for l in range(2):
            expected[f"blocks.{h}.layers.{l}.weight"] = (H, H)
            expected[f"blocks.{h}.layers.{l}.bias"] = (H,)
        expected[f"lm_heads.{h}.weight"] = (V, H)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected


def test_reload_is_bit_exact_and_tree_comes_back_as_tuples(tmp_path, llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    heads = _trained_heads(verifier, num_heads=4, num_layers=1, bias=False)
    tree = build_medusa_tree(torch.tensor([[0.5, 0.2, 0.1]] * 4), 16)
    save_medusa(tmp_path / "d", heads, verifier, tree=tree)
    loaded, meta = load_medusa(tmp_path / "d", verifier)
    assert (loaded.num_heads, loaded.num_layers, loaded.bias) == (4, 1, False)
    original = heads.state_dict()
    for key, value in loaded.state_dict().items():
        assert value.dtype == original[key].dtype and torch.equal(value, original[key]), key
    assert meta["tree"] == tree and all(isinstance(p, tuple) for p in meta["tree"])
    x = torch.randn(2, verifier.hidden_size)
    with torch.no_grad():
        assert torch.equal(loaded(x), heads(x))


def test_shared_head_exports_one_lm_head_as_vllm_reads_it(tmp_path, llama_dir):
    """shared_lm_head: `original_lm_head: true` and one `lm_head.weight` (the verifier's, in the heads' dtype);
    the reload decodes as the heads did."""
    verifier = Verifier.from_pretrained(llama_dir)
    H, V = verifier.hidden_size, verifier.vocab_size
    heads = MedusaHeads.from_verifier(verifier, 2, 1, shared_lm_head=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.02)
    save_medusa(tmp_path / "d", heads, verifier)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["original_lm_head"] is True and [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items() if "blocks" not in k} == {"lm_head.weight": (V, H)}
    assert torch.equal(tensors["lm_head.weight"], verifier.lm_head.weight)
    loaded, _ = load_medusa(tmp_path / "d", verifier)
    assert loaded.shared_lm_head and torch.equal(loaded.shared_head, verifier.lm_head.weight)
    x = torch.randn(2, H)
    with torch.no_grad():
        assert torch.equal(loaded(x), heads(x))
    loaded.place_shared_head(dtype=torch.bfloat16)
    assert loaded.shared_head.dtype == torch.bfloat16 and verifier.lm_head.weight.dtype == torch.float32
    # vLLM also reads the shared head as lm_heads.0.weight; so does load_medusa
    renamed = load_file(str(tmp_path / "d" / "model.safetensors"))
    renamed["lm_heads.0.weight"] = renamed.pop("lm_head.weight")
    save_file(renamed, str(tmp_path / "d" / "model.safetensors"), metadata={"format": "pt"})
    assert torch.equal(load_medusa(tmp_path / "d", verifier)[0].shared_head, verifier.lm_head.weight)
    config["original_lm_head"] = "yes"
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match=r"original_lm_head='yes'; expected true or false"):
        load_medusa(tmp_path / "d", verifier)


def test_bf16_heads_reload_in_bf16(tmp_path, llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    heads = MedusaHeads.from_verifier(verifier, 2, 1, dtype=torch.bfloat16)
    save_medusa(tmp_path / "d", heads, verifier)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded, meta = load_medusa(tmp_path / "d")
    assert loaded.dtype == torch.bfloat16 and meta["tree"] is None
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), heads.state_dict().values()))


def test_mismatched_verifier_is_refused_by_name(tmp_path, llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    save_medusa(tmp_path / "d", _trained_heads(verifier), verifier)
    other_weights = Verifier.from_pretrained(save_tiny_verifier(tmp_path / "seed1", "llama", seed=1))
    with pytest.raises(VerifierError, match="fingerprint"):
        load_medusa(tmp_path / "d", other_weights)
    narrower = Verifier.from_pretrained(save_tiny_verifier(tmp_path / "h32", "llama", hidden_size=32))
    with pytest.raises(VerifierError, match="hidden_size=64.*hidden_size=32"):
        load_medusa(tmp_path / "d", narrower)
    smaller_vocab = Verifier.from_pretrained(save_tiny_verifier(tmp_path / "v128", "llama", vocab_size=128))
    with pytest.raises(VerifierError, match="vocab_size"):
        load_medusa(tmp_path / "d", smaller_vocab)
    with pytest.raises(VerifierError, match="fingerprint"):
        load_medusa_verifier(tmp_path / "d", other_weights)


def test_corrupt_or_foreign_folders_are_named(tmp_path, llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    folder = save_medusa(tmp_path / "d", _trained_heads(verifier), verifier)
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["lm_heads.1.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(DrafterFormatError, match="lm_heads.1.weight"):
        load_medusa(folder)
    tensors["lm_heads.1.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(weights))
    with pytest.raises(DrafterFormatError, match=r"lm_heads.1.weight.*shape"):
        load_medusa(folder)

    folder = save_medusa(tmp_path / "e", _trained_heads(verifier), verifier)
    config = json.loads((folder / "config.json").read_text())
    del config["medusa_fc_bias"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match="medusa_fc_bias"):
        load_medusa(folder)
    config["medusa_fc_bias"], config["draftheads"]["method"] = True, "eagle"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match="method is 'eagle'"):
        load_medusa(folder)


def test_save_is_atomic_and_replaces(tmp_path, llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    save_medusa(tmp_path / "d", _trained_heads(verifier, seed=0), verifier)
    heads = _trained_heads(verifier, seed=1)
    save_medusa(tmp_path / "d", heads, verifier)
    loaded, _ = load_medusa(tmp_path / "d")
    assert torch.equal(loaded.lm_heads[0].weight, heads.lm_heads[0].weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp folders left behind


# ---- Medusa-2 --------------------------------------------------------------------------------------------------

def _perturb_adapters(verifier, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in verifier.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_round_trip(tmp_path, tiny_verifier_dirs, family):
    verifier = Verifier.from_pretrained(tiny_verifier_dirs[family])
    ids = torch.randint(0, verifier.vocab_size, (2, 8))
    base_logits = verifier.features(ids, return_logits=True).logits
    add_lora(verifier, r=4, alpha=8, dropout=0.0)
    _perturb_adapters(verifier)
    adapted = verifier.features(ids, return_logits=True).logits
    assert (adapted - base_logits).abs().max() > 1e-3
    heads = _trained_heads(verifier)
    folder = save_medusa(tmp_path / "d", heads, verifier)
    assert (folder / "adapter" / "adapter_config.json").is_file()
    assert (folder / "adapter" / "adapter_model.safetensors").is_file()
    meta = json.loads((folder / "config.json").read_text())["draftheads"]
    assert meta["adapter"] == "adapter" and meta["verifier"]["fingerprint"] == verifier.fingerprint

    fresh = Verifier.from_pretrained(tiny_verifier_dirs[family])
    loaded_heads, _ = load_medusa(folder, fresh)
    with_adapter = load_medusa_verifier(folder, fresh, merge=False)
    assert lora_model(with_adapter) is not None
    torch.testing.assert_close(with_adapter.features(ids, return_logits=True).logits, adapted, rtol=0, atol=0)
    merged = load_medusa_verifier(folder, Verifier.from_pretrained(tiny_verifier_dirs[family]))
    assert lora_model(merged) is None
    torch.testing.assert_close(merged.features(ids, return_logits=True).logits, adapted, rtol=1e-4, atol=1e-4)
    # the heads are checked against the base verifier, which the adapted one still names
    load_medusa(folder, merged)


def test_medusa1_drafter_leaves_the_verifier_alone(tmp_path, llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    save_medusa(tmp_path / "d", _trained_heads(verifier), verifier)
    assert load_medusa_verifier(tmp_path / "d", verifier) is verifier and lora_model(verifier) is None


def test_joint_training_step_moves_only_adapters_and_heads(llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    base = {k: v.clone() for k, v in verifier.model.state_dict().items()}
    add_lora(verifier, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    heads = MedusaHeads.from_verifier(verifier, num_heads=2, num_layers=1)
    joint = MedusaJoint(verifier, heads).train()
    ids = torch.randint(0, verifier.vocab_size, (2, 10))
    mask = torch.ones_like(ids)
    logits, head_logits = joint(ids)
    reference = joint.reference_logits(ids)
    assert logits.shape == (2, 10, verifier.vocab_size) and head_logits.shape == (2, 2, 10, verifier.vocab_size)
    assert not reference.requires_grad
    loss, parts = medusa2_loss(logits, reference, head_logits, ids, mask, mode="distill")
    # new LoRA adapters (B = 0) leave the verifier as it was: nothing to pull back yet
    assert parts["kl"].item() < 1e-10 and set(parts) == {"lm", "kl", "heads", "per_head"}
    groups = joint.param_groups(lr=1e-3, head_lr_multiplier=4.0)
    assert [g["lr"] for g in groups] == [1e-3, 4e-3]
    assert all("lora_" in n for n, p in joint.named_parameters() if p.requires_grad and not n.startswith("heads."))
    optimizer = torch.optim.SGD(groups, lr=1e-3)
    loss.backward()
    optimizer.step()
    # after a step the adapters act: the reference (adapters off) still equals the untouched base model
    logits, _ = joint(ids)
    reference = joint.reference_logits(ids)
    assert (logits - reference).abs().max() > 0
    base_model_state = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                        for k, v in lora_model(verifier).state_dict().items() if "lora_" not in k}
    for key, value in base.items():
        assert torch.equal(base_model_state[key], value), key
    with pytest.raises(VerifierError, match="already carries"):
        add_lora(verifier)


def test_bad_lora_targets_name_the_config_key(llama_dir):
    verifier = Verifier.from_pretrained(llama_dir)
    with pytest.raises(VerifierError, match="lora_target_modules"):
        add_lora(verifier, target_modules=["no_such_proj"])
