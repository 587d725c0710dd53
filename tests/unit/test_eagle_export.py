"""EAGLE export: names, shapes, dtypes and config fields against the spec; exact reload; refusal of other verifiers;
and an engine-style reference forward built only from the exported folder (HF Llama modules, vLLM semantics)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draftheads.models.eagle import EagleConfig, EagleError, build_drafter
from draftheads.models.export import DrafterFormatError, export_eagle, load_eagle
from draftheads.models.verifier import Verifier, VerifierError
from tests.utils import FAMILIES, save_tiny_verifier, unsettle_norms_and_biases

T = 10
H, V, I, KV, D = 64, 256, 128, 2, 16  # tiny verifier: hidden, vocab, intermediate, kv heads, head dim


@pytest.fixture(scope="module")
def verifiers(tiny_verifier_dirs):
    return {family: Verifier.from_pretrained(path) for family, path in tiny_verifier_dirs.items()}


def make(verifier, version, dtype=None, **kw):
    torch.manual_seed(0)
    counts = torch.randint(0, 50, (verifier.vocab_size,))
    cfg = EagleConfig(version=version, draft_vocab_size=100, **kw)
    drafter = build_drafter(verifier, cfg, token_counts=counts if version == 3 else None, dtype=dtype)
    return unsettle_norms_and_biases(drafter).eval()


def read(folder):
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def layer_spec(qkv_in, prefix="layers.0."):
    return {f"{prefix}self_attn.q_proj.weight": (H, qkv_in), f"{prefix}self_attn.k_proj.weight": (KV * D, qkv_in),
            f"{prefix}self_attn.v_proj.weight": (KV * D, qkv_in), f"{prefix}self_attn.o_proj.weight": (H, H),
            f"{prefix}mlp.gate_proj.weight": (I, H), f"{prefix}mlp.up_proj.weight": (I, H),
            f"{prefix}mlp.down_proj.weight": (H, I), f"{prefix}post_attention_layernorm.weight": (H,)}


# ---- the spec ------------------------------------------------------------------------------------------------
def test_eagle1_export_matches_spec(tmp_path, verifiers):
    verifier = verifiers["llama"]
    folder = export_eagle(make(verifier, 1), tmp_path / "e1", verifier, training={"steps": 3})
    config, tensors = read(folder)
    spec = {"fc.weight": (H, 2 * H), **layer_spec(H)}  # no fc bias by default: vLLM's fc has none
    assert {k: tuple(v.shape) for k, v in tensors.items()} == spec  # no input_layernorm, embed_tokens, lm_head
    assert all(v.dtype == torch.float32 for v in tensors.values())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["bias"] is False and config["attention_bias"] is False
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (H, I, V)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, KV, D)
    assert config["tie_word_embeddings"] is False and config["rope_theta"] == 10000.0
    meta = config["draftheads"]
    assert meta["method"] == "eagle1" and meta["layer_ids"] == [] and meta["training"] == {"steps": 3}
    assert meta["verifier"] == {**verifier.describe(), **verifier.content()}  # the files too: loading compares them
    assert meta["eagle"]["fc_bias"] is None and meta["eagle"]["version"] == 1
    # vLLM drops an fc bias without a word: an EAGLE-1 trained with one is refused for it, written for SGLang
    with pytest.raises(EagleError, match="eagle.fc_bias=true with engine vllm"):
        export_eagle(make(verifier, 1, fc_bias=True), tmp_path / "e1b", verifier)
    assert not (tmp_path / "e1b").exists()
    biased = export_eagle(make(verifier, 1, fc_bias=True), tmp_path / "e1s", verifier, engine="sglang")
    assert tuple(read(biased)[1]["fc.bias"].shape) == (H,) and read(biased)[0]["bias"] is False


def test_eagle3_export_matches_spec(tmp_path, verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier, 3, layer_ids=[1, 2, 3])
    folder = export_eagle(drafter, tmp_path / "e3", verifier)
    config, tensors = read(folder)
    spec = {"fc.weight": (H, 3 * H), **layer_spec(2 * H), "layers.0.input_layernorm.weight": (H,),
            "layers.0.hidden_norm.weight": (H,), "norm.weight": (H,), "lm_head.weight": (100, H),
            "d2t": (100,), "t2d": (V,)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == spec
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.float32 for k, v in tensors.items() if k not in ("d2t", "t2d"))
    assert int(tensors["t2d"].sum()) == 100
    expected = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                "hidden_size": H, "intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": KV,
                "head_dim": D, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 10000.0,
                "vocab_size": V, "draft_vocab_size": 100, "target_hidden_size": H, "tie_word_embeddings": False,
                "norm_before_residual": False, "bias": False, "attention_bias": False,
                # vLLM reads the top-level ids (inputs of layers 1, 2, 3); SGLang reads eagle_config's and adds one
                "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}}
    assert {k: config[k] for k in expected} == expected
    meta = config["draftheads"]
    assert meta["method"] == "eagle3" and meta["layer_ids"] == [1, 2, 3] and meta["engine"] == "vllm"
    assert meta["verifier"]["fingerprint"] == verifier.fingerprint


def test_qwen2_biases_are_exported_as_vllm_reads_them(tmp_path, verifiers):
    """q/k/v biases -> attention_bias true, and vLLM then builds o_proj with a bias too: a zero placeholder."""
    verifier = verifiers["qwen2"]
    for version in (1, 3):
        folder = export_eagle(make(verifier, version), tmp_path / f"q{version}", verifier)
        config, tensors = read(folder)
        assert config["attention_bias"] is True
        for name in ("q_proj", "k_proj", "v_proj"):
            assert tensors[f"layers.0.self_attn.{name}.bias"].abs().sum() > 0
        assert torch.equal(tensors["layers.0.self_attn.o_proj.bias"], torch.zeros(H))
        assert not any(k.startswith("layers.0.self_attn.o_proj.bias") for k in make(verifier, version).state_dict())


def test_sglang_flavour(tmp_path, verifiers):
    verifier = verifiers["llama"]
    config, tensors = read(export_eagle(make(verifier, 3, layer_ids=[1, 2, 3]), tmp_path / "s3", verifier,
                                        engine="sglang"))
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang adds 1 back
    assert "midlayer.self_attn.q_proj.weight" in tensors and not any(k.startswith("layers.") for k in tensors)
    config, tensors = read(export_eagle(make(verifier, 1, fc_bias=False), tmp_path / "s1", verifier,
                                        engine="sglang"))
    # bias false: SGLang's attention reads `attention_bias or bias`; its fc has a bias whatever the config says
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["bias"] is False
    assert torch.equal(tensors["fc.bias"], torch.zeros(H))  # SGLang's EAGLE-1 fc always has a bias
    with pytest.raises(ValueError, match="layer 0"):
        export_eagle(make(verifier, 3, layer_ids=[0, 1, 2]), tmp_path / "s0", verifier, engine="sglang")
    # What SGLang would serve wrong without a word is refused: q/k/v biases (Qwen2's), norm_before_residual
    with pytest.raises(EagleError, match="eagle.qkv_bias=true with engine sglang"):
        export_eagle(make(verifiers["qwen2"], 3), tmp_path / "sq", verifiers["qwen2"], engine="sglang")
    with pytest.raises(EagleError, match="eagle.norm_before_residual=true with engine sglang"):
        export_eagle(make(verifier, 3, norm_before_residual=True), tmp_path / "sn", verifier, engine="sglang")
    assert not any((tmp_path / name).exists() for name in ("sq", "sn"))


def test_exported_config_reads_as_a_llama_config(tmp_path, verifiers):
    from transformers import LlamaConfig

    verifier = verifiers["llama"]
    config, _ = read(export_eagle(make(verifier, 3), tmp_path / "e3", verifier))
    lc = LlamaConfig(**{k: v for k, v in config.items() if k != "draftheads"})
    assert lc.rope_parameters["rope_theta"] == verifier.config.rope_parameters["rope_theta"]
    assert lc.num_hidden_layers == 1 and lc.head_dim == D


# ---- reload --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_reload_is_exact(tmp_path, verifiers, family, version, engine):
    verifier = verifiers[family]
    sglang3 = {"qkv_bias": False} if (engine, version) == ("sglang", 3) else {}  # SGLang's EAGLE-3 has no qkv bias
    drafter = make(verifier, version, layer_ids=[1, 2, 3] if version == 3 else None, **sglang3)
    loaded = load_eagle(export_eagle(drafter, tmp_path / "d", verifier, engine=engine), verifier)
    assert type(loaded) is type(drafter) and loaded.cfg == drafter.cfg
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    ids = torch.randint(3, V, (2, T))
    hidden = torch.randn(2, T, H)
    with torch.no_grad():
        assert torch.equal(drafter.logits(drafter(ids, hidden)[0]), loaded.logits(loaded(ids, hidden)[0]))


def test_reload_keeps_bf16(tmp_path, verifiers):
    verifier = verifiers["llama"]
    drafter = make(verifier, 3, dtype=torch.bfloat16)
    loaded = load_eagle(export_eagle(drafter, tmp_path / "bf", verifier), verifier)
    assert loaded.dtype == torch.bfloat16
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in drafter.state_dict().items())
    assert read(tmp_path / "bf")[1]["fc.weight"].dtype == torch.bfloat16


# ---- refusal and corruption ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory, verifiers):
    folder = tmp_path_factory.mktemp("eagle") / "e3"
    return export_eagle(make(verifiers["llama"], 3), folder, verifiers["llama"])


@pytest.mark.parametrize("override,field", [({"seed": 7}, "fingerprint"), ({"hidden_size": 32}, "hidden_size"),
                                            ({"num_layers": 5}, "num_hidden_layers"),
                                            ({"vocab_size": 300}, "vocab_size")])
def test_other_verifiers_are_refused(tmp_path, exported, override, field):
    other = Verifier.from_pretrained(save_tiny_verifier(tmp_path / "other", "llama", **override))
    with pytest.raises(VerifierError, match=field):
        load_eagle(exported, other)


def test_corrupt_folders_name_the_problem(tmp_path, exported, verifiers):
    verifier = verifiers["llama"]
    config, tensors = read(exported)

    def write(name, cfg, ts):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
        save_file(ts, str(folder / "model.safetensors"))
        return folder

    missing = {k: v for k, v in tensors.items() if k != "norm.weight"}
    with pytest.raises(DrafterFormatError, match="missing weight 'norm.weight'"):
        load_eagle(write("missing", config, missing), verifier)
    bad_dtype = {**tensors, "d2t": tensors["d2t"].int()}
    with pytest.raises(DrafterFormatError, match="d2t"):
        load_eagle(write("dtype", config, bad_dtype), verifier)
    wrong_shape = {**tensors, "fc.weight": torch.zeros(H, 2 * H)}
    with pytest.raises(DrafterFormatError, match=r"'fc.weight' has shape \(64, 128\), expected \(64, 192\)"):
        load_eagle(write("shape", config, wrong_shape), verifier)
    placeholder = {**tensors, "layers.0.self_attn.o_proj.bias": torch.ones(H)}
    with pytest.raises(DrafterFormatError, match="unexpected weight"):
        load_eagle(write("extra", config, placeholder), verifier)
    with pytest.raises(DrafterFormatError, match="method is 'medusa'"):
        load_eagle(write("medusa", {**config, "draftheads": {**config["draftheads"], "method": "medusa"}}, tensors),
                   verifier)


def test_nonzero_placeholder_is_refused(tmp_path, verifiers):
    verifier = verifiers["qwen2"]
    folder = export_eagle(make(verifier, 3), tmp_path / "q", verifier)
    config, tensors = read(folder)
    tensors["layers.0.self_attn.o_proj.bias"] = torch.full((H,), 0.5)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(DrafterFormatError, match="o_proj.bias' is non-zero"):
        load_eagle(folder, verifier)


# ---- what an engine computes from the folder alone -------------------------------------------------------------
def engine_reference(folder, verifier, ids, feats, positions):
    """Draft logits over the verifier's vocab, computed the way vLLM's llama_eagle(3).py does, from HF Llama modules
    and nothing but the exported config.json and weights (-inf outside the draft vocabulary)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

    config, w = read(folder)
    lc = LlamaConfig(**{k: v for k, v in config.items() if k not in ("draftheads", "eagle_config")})
    lc._attn_implementation = "eager"
    eagle3 = config["architectures"] == ["LlamaForCausalLMEagle3"]

    def load(module, prefix):
        module.load_state_dict({k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}, strict=True)
        return module

    attn = LlamaAttention(lc, layer_idx=0)
    if eagle3:  # q/k/v read [embeds; hidden], 2H wide
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, torch.nn.Linear(2 * lc.hidden_size, old.out_features, bias=lc.attention_bias))
    load(attn, "layers.0.self_attn.")
    mlp = load(LlamaMLP(lc), "layers.0.mlp.")

    def norm(name):
        return load(LlamaRMSNorm(lc.hidden_size, eps=lc.rms_norm_eps), name + ".")

    embeds = verifier.embed_tokens(ids)
    if eagle3:
        hidden = F.linear(torch.cat(feats, -1), w["fc.weight"])
        residual = hidden
        x = torch.cat([norm("layers.0.input_layernorm")(embeds), norm("layers.0.hidden_norm")(hidden)], -1)
    else:
        x = F.linear(torch.cat([embeds, feats[0]], -1), w["fc.weight"], w.get("fc.bias"))
        residual = x  # no input_layernorm
    n = ids.shape[1]
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    a, _ = attn(x, position_embeddings=LlamaRotaryEmbedding(lc)(x, positions), attention_mask=causal)
    h = residual + a
    out = h + mlp(norm("layers.0.post_attention_layernorm")(h))
    if not eagle3:
        return verifier.lm_head(out)
    draft_logits = F.linear(norm("norm")(out), w["lm_head.weight"])
    targets = torch.arange(config["draft_vocab_size"]) + w["d2t"]
    logits = torch.full((*draft_logits.shape[:-1], config["vocab_size"]), float("-inf"))
    logits[..., targets] = draft_logits
    return logits


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("version", [1, 3])
def test_engine_reference_from_the_folder_matches(tmp_path, verifiers, family, version):
    verifier = verifiers[family]
    drafter = make(verifier, version, layer_ids=[1, 2, 3] if version == 3 else None)
    folder = export_eagle(drafter, tmp_path / "d", verifier)
    ids = torch.randint(3, V, (2, T))
    feats = verifier.features(ids, layer_ids=drafter.feature_layers)
    feats = feats.layers if version == 3 else [feats.final]
    positions = torch.arange(3, 3 + T).expand(2, T)
    with torch.no_grad():
        ref = engine_reference(folder, verifier, ids, feats, positions)
        ours = drafter.logits(drafter(ids, drafter.project_features(feats), positions)[0])
        if version == 3:  # place draft logits at their target ids, as vLLM's compute_logits does
            full = torch.full_like(ref, float("-inf"))
            full[..., drafter.to_target_ids(torch.arange(drafter.draft_vocab_size))] = ours
            ours = full
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


# ---- what the engines showed (issue: served, not just shaped) ------------------------------------------------------
def test_full_vocabulary_eagle3_has_no_maps_and_reloads(tmp_path, verifiers):
    """A draft vocabulary as large as the verifier's: no d2t / t2d in the file (vLLM refuses a d2t then, with
    'There is no module or parameter named draft_id_to_target_id'), draft_vocab_size = V; reloads exactly."""
    verifier = verifiers["llama"]
    drafter = build_drafter(verifier, EagleConfig(version=3, draft_vocab_size=None, layer_ids=[1, 2, 3])).eval()
    assert drafter.full_vocab
    config, tensors = read(export_eagle(drafter, tmp_path / "full", verifier))
    assert "d2t" not in tensors and "t2d" not in tensors and config["draft_vocab_size"] == V
    assert tuple(tensors["lm_head.weight"].shape) == (V, H)
    loaded = load_eagle(tmp_path / "full", verifier)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))
    # a pruned vocabulary still needs its map: without it vLLM would read draft id i as target id i
    pruned = export_eagle(make(verifier, 3), tmp_path / "pruned", verifier)
    tensors = load_file(str(pruned / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(pruned / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DrafterFormatError, match=r"`d2t` missing .*draft_vocab_size 100 < the verifier's 256"):
        load_eagle(pruned, verifier)


def test_layer_ids_must_increase():
    """vLLM and SGLang concatenate the features in layer order: another order would swap fc's blocks."""
    with pytest.raises(EagleError, match=r"eagle.layer_ids=\[3, 1, 2\]: expected distinct ids in increasing order"):
        EagleConfig(layer_ids=[3, 1, 2])
    with pytest.raises(EagleError, match="increasing"):
        EagleConfig(layer_ids=[1, 1, 2])


def test_speculators_flavour(tmp_path, verifiers, tiny_verifier_dirs):
    """The speculators library's format: speculators_config names the verifier's folder and K, the norm flags are
    all written out, layer ids at the top level, the verifier's embedding included; reloads exactly."""
    verifier = verifiers["llama"]
    drafter = make(verifier, 3, layer_ids=[1, 2, 3])
    folder = export_eagle(drafter, tmp_path / "spec", verifier, engine="speculators", num_speculative_tokens=4)
    config, tensors = read(folder)
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"]["name_or_path"] == str(tiny_verifier_dirs["llama"].resolve())
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["draft_vocab_size"] == 100
    assert {k: config[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == \
        dict.fromkeys(("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False)
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["hidden_size"] == H
    assert torch.equal(tensors["embed_tokens.weight"], verifier.embed_tokens.weight.float())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.hidden_norm.weight"} <= set(tensors)
    loaded = load_eagle(folder, verifier)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))
    # an embedding that is not the verifier's is a drafter we would decode differently from the engines
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"] + 1
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DrafterFormatError, match="not the verifier's token embedding"):
        load_eagle(folder, verifier)
    with pytest.raises(EagleError, match="no EAGLE-1 format"):
        export_eagle(make(verifier, 1), tmp_path / "spec1", verifier, engine="speculators")


def test_engine_rules_apply_when_the_run_config_is_read():
    """A run that would export something an engine reads differently stops before it trains, naming the key and
    the engine; settings left unset take the engine's choice."""
    from draftheads.train.config import ConfigError, parse_config
    from draftheads.train.eagle import EagleRunConfig

    configs = Path(__file__).resolve().parents[2] / "configs"
    base = ["--config", str(configs / "eagle3-tiny.yaml")]
    with pytest.raises(ConfigError, match="eagle.norm_before_residual=true with engine sglang"):
        parse_config(EagleRunConfig, [*base, "--engine=sglang", "--eagle.norm_before_residual=true"])
    with pytest.raises(ConfigError, match="eagle.fc_bias=true with engine vllm"):
        parse_config(EagleRunConfig, ["--config", str(configs / "eagle1-tiny.yaml"), "--eagle.fc_bias=true"])
    with pytest.raises(ConfigError, match="no EAGLE-1 format"):
        parse_config(EagleRunConfig, ["--config", str(configs / "eagle1-tiny.yaml"), "--engine=speculators"])
    assert parse_config(EagleRunConfig, [*base, "--engine=sglang"]).eagle.qkv_bias is False  # SGLang has none
    assert parse_config(EagleRunConfig, base).eagle.qkv_bias is None  # vLLM: as the verifier's family


def test_a_folder_under_another_layout_than_it_records_is_refused(tmp_path, verifiers):
    """The export records its layout; a folder whose files are in another (a vLLM export relabelled sglang, as a
    hand conversion might leave it) is refused rather than read under the wrong names or layer ids."""
    verifier = verifiers["llama"]
    folder = export_eagle(make(verifier, 3, layer_ids=[1, 2, 3]), tmp_path / "e3", verifier)
    config = json.loads((folder / "config.json").read_text())
    assert config["draftheads"]["engine"] == "vllm"
    config["draftheads"]["engine"] = "sglang"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match="missing weight 'midlayer"):
        load_eagle(folder, verifier)
