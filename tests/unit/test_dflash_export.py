"""DFlash export: z-lab's layout as vLLM 0.32 reads it (eval/interop/vllm_reading.py's DFlash reading, which
serve-check proves against real vLLM) and as transformers' Qwen3Config parses it; the speculators format through
vLLM's conversion; exact reload; refusals naming the key."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from draftheads.eval.interop.vllm_reading import Unreadable, dflash_expected_weights, dflash_pretrained, \
    dflash_reading
from draftheads.models.dflash import DFlashConfig, DFlashError, build_drafter
from draftheads.models.export import DrafterFormatError, check_dflash_engine, check_dflash_verifier, \
    export_dflash, load_dflash
from draftheads.models.verifier import Verifier, VerifierError


@pytest.fixture(scope="module")
def verifiers(tiny_verifier_dirs):
    return {family: Verifier.from_pretrained(path) for family, path in tiny_verifier_dirs.items()}


def make(verifier, dtype=None, **kw):
    torch.manual_seed(0)
    cfg = DFlashConfig(**{"num_hidden_layers": 2, "block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": 5,
                          **kw})
    drafter = build_drafter(verifier, cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # a norm left out or swapped shows
    return drafter.eval()


def read(folder):
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def test_vllm_layout_is_what_vllm_reads(tmp_path, verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier)
    folder = export_dflash(drafter, tmp_path / "d", verifier, training={"steps": 3})
    config, tensors = read(folder)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [0, 2]}
    assert config["block_size"] == 4 and config["num_hidden_layers"] == 2 and config["num_target_layers"] == 4
    assert "eagle_aux_hidden_state_layer_ids" not in config  # vLLM would take it over dflash_config's ids
    meta = config["draftheads"]
    assert meta["method"] == "dflash" and meta["engine"] == "vllm" and meta["layer_ids"] == [0, 2]
    # vLLM's reading: the layers it captures (target + 1 = the inputs our engine reads), the mask token, the layer
    reading = dflash_reading(config, tensors, verifier)
    assert reading.target_layer_ids == [0, 2] and reading.mask_token_id == 5
    assert reading.layer_types == ["full_attention"] * 2 and reading.unsupported(verifier) == []
    cfg = drafter.cfg
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "hidden_act"):
        assert reading.layer[key] == getattr(cfg, key), key
    # every weight vLLM builds, and nothing else (no embed_tokens / lm_head / mask_hidden: the verifier's are used)
    assert set(tensors) == set(dflash_expected_weights(reading)) == set(drafter.state_dict())
    assert tensors["fc.weight"].shape == (64, 2 * 64)
    assert all(v.dtype == torch.float32 for v in tensors.values())
    # transformers (what vLLM and the reference package parse config.json with) reads the layer as trained
    parsed = Qwen3Config(**{k: v for k, v in config.items() if k != "draftheads"})
    assert parsed.head_dim == cfg.head_dim and parsed.layer_types == ["full_attention"] * 2
    assert parsed.rope_parameters["rope_theta"] == cfg.rope_theta and parsed.dflash_config["target_layer_ids"] == [0, 2]


def test_reload_is_exact_and_checks_fields(tmp_path, verifiers):
    verifier = verifiers["qwen2"]
    drafter = make(verifier, dtype=torch.bfloat16)
    folder = export_dflash(drafter, tmp_path / "d", verifier)
    back = load_dflash(folder, verifier)
    assert back.dtype == torch.bfloat16 and back.cfg == drafter.cfg
    for key, value in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    config, tensors = read(folder)
    config["dflash_config"]["target_layer_ids"] = [1, 2]  # edited after training
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match="dflash_config"):
        load_dflash(folder, verifier)
    with pytest.raises(VerifierError):
        load_dflash(export_dflash(drafter, tmp_path / "e", verifier), verifiers["llama"])
    del tensors["norm.weight"]
    folder = export_dflash(drafter, tmp_path / "f", verifier)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(DrafterFormatError, match="norm.weight"):
        load_dflash(folder, verifier)


def test_speculators_format_through_vllms_conversion(tmp_path, verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier)
    folder = export_dflash(drafter, tmp_path / "s", verifier, engine="speculators")
    config, tensors = read(folder)
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [1, 3]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(verifier.path.resolve())
    assert config["sliding_window_non_causal"] is True  # else vLLM makes every layer causal
    pre = dflash_pretrained(config)
    assert pre["dflash_config"]["causal"] is False and pre["architectures"] == ["DFlashDraftModel"]
    reading = dflash_reading(config, tensors, verifier)
    assert reading.target_layer_ids == [0, 2] and reading.mask_token_id == 5 and reading.unsupported(verifier) == []
    assert reading.layer_types == ["full_attention"] * 2
    back = load_dflash(folder, verifier)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_sliding_layers_survive_the_parse(tmp_path, verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    config, tensors = read(export_dflash(drafter, tmp_path / "w", verifier))
    parsed = Qwen3Config(**{k: v for k, v in config.items() if k != "draftheads"})
    assert parsed.layer_types == ["sliding_attention", "full_attention"] and parsed.sliding_window == 8
    reading = dflash_reading(config, tensors, verifier)
    assert reading.layer_types == ["sliding_attention", "full_attention"] and reading.sliding_window == 8


def test_engine_refusals_name_the_key(verifiers):
    with pytest.raises(DFlashError, match=r"dflash.target_layer_ids=\[2, 0\] with engine vllm"):
        check_dflash_engine(DFlashConfig(num_hidden_layers=2, target_layer_ids=[2, 0]), "vllm")
    mixed = DFlashConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    check_dflash_engine(mixed, "vllm")
    with pytest.raises(DFlashError, match="dflash.layer_types=.*engine speculators"):
        check_dflash_engine(mixed, "speculators")
    with pytest.raises(DFlashError, match="engine='tensorrt'"):
        check_dflash_engine(DFlashConfig(), "tensorrt")


def test_sglang_is_refused_for_a_verifier_it_cannot_capture(tmp_path, verifiers):
    """SGLang 0.5.23 has no DFlash capture for Qwen2 (tests/e2e/interop/test_sglang.py): refused, naming both."""
    with pytest.raises(DFlashError, match=r"^engine sglang with a qwen2 verifier: SGLang 0\.5\.23 has no DFlash"):
        check_dflash_verifier("sglang", verifiers["qwen2"])
    with pytest.raises(DFlashError, match="engine sglang with a qwen2 verifier"):
        export_dflash(make(verifiers["qwen2"]), tmp_path / "q2", verifiers["qwen2"], engine="sglang")
    assert not (tmp_path / "q2").exists()
    check_dflash_verifier("vllm", verifiers["qwen2"])
    check_dflash_verifier("sglang", verifiers["llama"])


def test_vllms_reading_of_other_folders(tmp_path, verifiers):
    """What vLLM 0.32 reads from DFlash folders that are not ours as written: the top-level aux ids win over
    dflash_config's; a speculators folder saying sliding_window_non_causal: false makes every layer causal; a
    missing rope_theta is Qwen3's 1e6; a mask_hidden weight is refused; an own embedding is the drafter's."""
    verifier = verifiers["llama"]
    config, tensors = read(export_dflash(make(verifier), tmp_path / "d", verifier))
    zlab = {k: v for k, v in config.items() if k != "draftheads"}
    assert dflash_reading(zlab, tensors, verifier).unsupported(verifier) == []  # z-lab's own shape: readable
    reading = dflash_reading({**zlab, "eagle_aux_hidden_state_layer_ids": [2, 3]}, tensors, verifier)
    assert reading.target_layer_ids == [1, 2] and "eagle_aux_hidden_state_layer_ids" in reading.target_layer_ids_from
    causal = dflash_reading({**zlab, "is_causal": True}, tensors, verifier)
    assert causal.layer_types == ["causal_full"] * 2 and "causal_full" in causal.unsupported(verifier)[0]
    no_theta = {k: v for k, v in zlab.items() if k not in ("rope_theta", "rope_parameters")}
    assert dflash_reading(no_theta, tensors, verifier).layer["rope_theta"] == 1e6
    assert "mask_hidden" in dflash_reading(zlab, {**tensors, "mask_hidden": torch.zeros(3)}, verifier).refused
    own = dflash_reading(zlab, {**tensors, "embed_tokens.weight": torch.zeros(verifier.vocab_size, 64)}, verifier)
    assert own.own_embedding and own.unsupported(verifier)
    spec, spec_tensors = read(export_dflash(make(verifier), tmp_path / "s", verifier, engine="speculators"))
    spec["sliding_window_non_causal"] = False  # the speculators library's default when saving
    assert dflash_reading(spec, spec_tensors, verifier).layer_types == ["causal_full"] * 2


def _own_head(verifier, size):
    """A drafter with its own lm_head over the `size` most frequent tokens of a made-up count, its rows moved off
    the verifier's (as training would)."""
    counts = torch.arange(verifier.vocab_size).flip(0) * 3 % 17  # a vocabulary order that is not the id order
    torch.manual_seed(0)
    cfg = DFlashConfig(num_hidden_layers=2, block_size=4, target_layer_ids=[0, 2], mask_token_id=5,
                       draft_vocab_size=size)
    drafter = build_drafter(verifier, cfg, token_counts=counts)
    with torch.no_grad():
        drafter.lm_head.weight.add_(torch.randn_like(drafter.lm_head.weight) * 0.1)
    return drafter.eval()


@pytest.mark.parametrize("pruned", [True, False])
def test_own_lm_head_is_written_read_back_and_read_by_vllm(tmp_path, verifiers, pruned):
    """dflash.draft_vocab_size: lm_head.weight (+ d2t / t2d for a pruned vocabulary) and draft_vocab_size in the
    export; our reload and vLLM's reading give the drafter that wrote it (the same logits), and its logits are -inf
    outside the draft vocabulary."""
    verifier = verifiers["llama"]
    size = 100 if pruned else verifier.vocab_size
    drafter = _own_head(verifier, size)
    start = verifier.lm_head.weight[drafter.draft_token_ids()]
    assert drafter.lm_head.weight.shape == (size, 64) and not torch.equal(drafter.lm_head.weight, start)
    folder = export_dflash(drafter, tmp_path / "d", verifier)
    config, tensors = read(folder)
    assert config["draft_vocab_size"] == size and tensors["lm_head.weight"].shape == (size, 64)
    assert ("d2t" in tensors and "t2d" in tensors) == pruned  # vLLM refuses a d2t over the whole vocabulary
    reading = dflash_reading({k: v for k, v in config.items() if k != "draftheads"}, tensors, verifier)
    assert reading.own_lm_head and reading.unsupported(verifier) == []
    hidden = torch.randn(2, 3, 64)
    with torch.no_grad():
        want = drafter.logits(hidden)
        for other in (load_dflash(folder, verifier), reading.drafter(verifier)):
            assert torch.equal(other.logits(hidden), want)
    outside = torch.ones(verifier.vocab_size, dtype=torch.bool)
    outside[drafter.draft_token_ids()] = False
    assert int(outside.sum()) == verifier.vocab_size - size and torch.isinf(want[..., outside]).all()
    assert not torch.isinf(want[..., ~outside]).any()
    for engine in ("speculators", "sglang"):
        with pytest.raises(DFlashError, match=f"dflash.draft_vocab_size=100 with engine {engine}"):
            check_dflash_engine(DFlashConfig(draft_vocab_size=100), engine)
    if pruned:  # a pruned vocabulary needs the data's counts, and a d2t vLLM can map with
        with pytest.raises(DFlashError, match="draft_vocab_size=100 < vocab"):
            build_drafter(verifier, DFlashConfig(num_hidden_layers=1, draft_vocab_size=100))
        no_map = dflash_reading(config, {k: v for k, v in tensors.items() if k != "d2t"}, verifier)
        assert "without a d2t" in no_map.unsupported(verifier)[0]
        # another trainer's numbering (draft ids not in target order): read as the same drafter, renumbered
        perm = torch.randperm(size, generator=torch.Generator().manual_seed(0))
        targets = (torch.arange(size) + tensors["d2t"])[perm]
        shuffled = {**tensors, "d2t": targets - torch.arange(size), "lm_head.weight": tensors["lm_head.weight"][perm]}
        with torch.no_grad():
            assert torch.equal(dflash_reading(config, shuffled, verifier).drafter(verifier).logits(hidden), want)
        outside_vocab = {**tensors, "d2t": tensors["d2t"] + verifier.vocab_size}  # a target id past the vocabulary
        with pytest.raises(Unreadable, match="outside the verifier's vocabulary"):
            dflash_reading(config, outside_vocab, verifier).drafter(verifier)
