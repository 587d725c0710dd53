"""The importer (eval/interop/peer_folder.py) on small synthetic folders shaped as SpecForge 0.2 and speculators
0.9 write them (tests/peer_folders.py): each defect vLLM would read wrongly is found, named, and fixed, and the
fixed folder is what draftheads loads and vLLM's reading (eval/interop/vllm_reading.py) builds, equal to the
drafter as trained (its weights as the peer stored them). Defects with no fix refuse the fix by name. That vLLM
itself reads the fixed folders as trained is tests/e2e/interop/test_serve_check.py's."""

from __future__ import annotations

import json

import pytest
import torch

from draftheads.eval.interop import peer_folder
from draftheads.eval.interop.peer_folder import PeerFolderError, findings, fix, inspect
from draftheads.eval.interop.vllm_reading import vllm_flags, vllm_layer_ids
from draftheads.models.eagle import EagleConfig, build_drafter
from draftheads.models.export import export_eagle, load_eagle
from draftheads.models.verifier import Verifier
from tests.peer_folders import specforge_folder, speculators_folder
from tests.utils import save_tiny_verifier

pytestmark = pytest.mark.unit
L = 8  # vLLM's default layers (2, 4, 5) are distinct from 8 layers up


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    return Verifier.from_pretrained(save_tiny_verifier(tmp_path_factory.mktemp("v") / "v", num_layers=L))


def drafter(verifier, layer_ids=(1, 3, 6), pruned=True, seed=0):
    torch.manual_seed(seed)
    counts = torch.randint(0, 100, (verifier.vocab_size,))
    d = build_drafter(verifier, EagleConfig(layer_ids=list(layer_ids), draft_vocab_size=100 if pruned else None),
                      token_counts=counts if pruned else None)
    with torch.no_grad():  # every weight non-trivial, so a dropped or misplaced one shows
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d


def rounded(d, dtype=torch.bfloat16) -> dict:
    return {k: v.to(dtype).float() if v.is_floating_point() else v for k, v in d.state_dict().items()}


def assert_fixed_as_trained(folder, out, verifier, want: dict):
    """The fixed folder: no finding left, draftheads loads it, vLLM's reading of it is the drafter as trained."""
    fixed = inspect(out, verifier)
    assert findings(fixed) == [], [f.line() for f in findings(fixed)]
    loaded = load_eagle(out, verifier).state_dict()
    served = fixed.served.drafter(verifier).state_dict()
    for key, value in want.items():
        assert torch.equal(loaded[key], value), key
        assert torch.equal(served[key], value), key
    meta = json.loads((out / "config.json").read_text())["draftheads"]["training"]["imported"]
    assert meta["from"] == str(folder.resolve())


def test_specforge_export_layer_ids_found_and_fixed(verifier, tmp_path):
    d = drafter(verifier)
    folder = specforge_folder(d, tmp_path / "sf")
    ins = inspect(folder, verifier)
    assert ins.kind == "specforge"
    keys = [f.key for f in findings(ins)]
    assert keys == ["eagle_aux_hidden_state_layer_ids"], keys
    assert ins.served.layer_ids == [2, 4, 5] and ins.trained.layer_ids == [1, 3, 6]
    assert "vLLM's default (2, L//2, L-3)" in findings(ins)[0].vllm
    assert any("bfloat16" in n for n in ins.notes)
    out = fix(ins, tmp_path / "fixed", verifier)
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert_fixed_as_trained(folder, out, verifier, rounded(d))


def test_full_vocabulary_d2t_is_refused_by_vllm_and_dropped(verifier, tmp_path):
    d = drafter(verifier, layer_ids=(2, 4, 5), pruned=False)  # vLLM's default layers: only the map is wrong
    folder = specforge_folder(d, tmp_path / "sf", eagle_config_ids=False)
    ins = inspect(folder, verifier)
    (finding,) = findings(ins)
    assert finding.key == "d2t" and "draft_id_to_target_id" in finding.vllm and finding.fix.startswith("drop")
    out = fix(ins, tmp_path / "fixed", verifier)
    from safetensors.torch import load_file

    assert "d2t" not in load_file(out / "model.safetensors")
    assert_fixed_as_trained(folder, out, verifier, {k: v for k, v in rounded(d).items() if k not in ("d2t", "t2d")})


def test_full_vocabulary_permutation_becomes_lm_head_order(verifier, tmp_path):
    d = drafter(verifier, layer_ids=(2, 4, 5), pruned=False)
    folder = specforge_folder(d, tmp_path / "sf", dtype=torch.float32, eagle_config_ids=False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    perm = torch.randperm(verifier.vocab_size, generator=torch.Generator().manual_seed(0))
    tensors["d2t"] = perm - torch.arange(verifier.vocab_size)  # draft id i is target perm[i]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][perm]
    save_file(tensors, str(folder / "model.safetensors"))
    out = fix(inspect(folder, verifier), tmp_path / "fixed", verifier)
    assert_fixed_as_trained(folder, out, verifier, {"lm_head.weight": d.lm_head.weight.detach()})


def test_missing_d2t_reads_draft_ids_as_target_ids_and_is_restored_from_t2d(verifier, tmp_path):
    d = drafter(verifier, layer_ids=(2, 4, 5))
    folder = specforge_folder(d, tmp_path / "sf", eagle_config_ids=False, maps=False)
    (finding,) = findings(inspect(folder, verifier))
    assert finding.key == "d2t" and finding.vllm == "no d2t: draft id i as target id i"
    out = fix(inspect(folder, verifier), tmp_path / "fixed", verifier)
    assert_fixed_as_trained(folder, out, verifier, rounded(d))


def test_specforge_norm_output_means_another_thing(verifier, tmp_path):
    d = drafter(verifier, layer_ids=(2, 4, 5))
    ins = inspect(specforge_folder(d, tmp_path / "on", eagle_config_ids=False, norm_output=True), verifier)
    (finding,) = findings(ins)
    assert (finding.key, finding.vllm, finding.trained, finding.fix) == ("norm_output", "true", "false",
                                                                         "write norm_output: false")
    assert_fixed_as_trained(ins.folder, fix(ins, tmp_path / "fixed", verifier), verifier, rounded(d))
    off = inspect(specforge_folder(d, tmp_path / "off", eagle_config_ids=False, norm_output=False), verifier)
    assert [f.key for f in findings(off)] == ["norm_output"] and findings(off)[0].fix is None
    with pytest.raises(PeerFolderError, match="cannot fix norm_output"):
        fix(off, tmp_path / "nope", verifier)


def test_speculators_checkpoint_embedding_and_norm_default(verifier, tmp_path):
    d = drafter(verifier)
    folder = speculators_folder(d, verifier, tmp_path / "sp", drop_keys=("norm_before_residual",))
    ins = inspect(folder, verifier)
    assert ins.kind == "speculators" and ins.served.layer_ids == [1, 3, 6]
    lines = {f.key: f for f in findings(ins)}
    assert set(lines) == {"norm_before_residual", "embed_tokens.weight"}, [f.line() for f in findings(ins)]
    assert (lines["norm_before_residual"].vllm, lines["norm_before_residual"].trained) == ("true", "false")
    out = fix(ins, tmp_path / "fixed", verifier)
    assert_fixed_as_trained(folder, out, verifier, rounded(d))
    clean = speculators_folder(d, verifier, tmp_path / "fp32", dtype=torch.float32)
    assert findings(inspect(clean, verifier)) == []  # the verifier's embedding, unrounded: vLLM shares it


def test_layer_ids_the_folder_does_not_record(verifier, tmp_path):
    d = drafter(verifier)
    folder = specforge_folder(d, tmp_path / "sf", eagle_config_ids=False)
    assert findings(inspect(folder, verifier)) == []  # taken as SpecForge's default capture: vLLM's default
    ins = inspect(folder, verifier, layer_ids=[1, 3, 6])
    assert [f.key for f in findings(ins)] == ["eagle_aux_hidden_state_layer_ids"]
    assert ins.trained.layer_ids_from == "--layer-ids"


def test_what_cannot_be_fixed_is_named(verifier, tmp_path):
    d = drafter(verifier)
    missing = inspect(specforge_folder(d, tmp_path / "sf", drop=("layers.0.hidden_norm.weight",)), verifier)
    assert any(f.key == "layers.0.hidden_norm.weight" and f.fix is None for f in findings(missing))
    with pytest.raises(PeerFolderError, match="cannot fix layers.0.hidden_norm.weight"):
        fix(missing, tmp_path / "a", verifier)
    folder = speculators_folder(d, verifier, tmp_path / "nbf", dtype=torch.float32, set_keys={"norm_before_fc": True})
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["input_norm.weight"] = torch.ones(3 * verifier.hidden_size)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(PeerFolderError, match="norm_before_fc is true; draftheads drafters have no norm_before_fc"):
        fix(inspect(folder, verifier), tmp_path / "b", verifier)
    config = json.loads((folder / "config.json").read_text())
    config["norm_before_fc"] = False  # the weight stays: vLLM drops it without a word
    (folder / "config.json").write_text(json.dumps(config))
    dropped = [f for f in findings(inspect(folder, verifier)) if f.key == "input_norm.weight"]
    assert len(dropped) == 1 and dropped[0].fix is None and "drops the weight" in dropped[0].vllm


def test_our_export_edited_after_training(verifier, tmp_path):
    """The layer ids edited in config.json, both copies: vLLM reads the edit, the record says otherwise."""
    d = drafter(verifier)
    folder = export_eagle(d, tmp_path / "ours", verifier)
    assert findings(inspect(folder, verifier)) == []
    config = json.loads((folder / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [-1, 0, 1]
    (folder / "config.json").write_text(json.dumps(config))
    ins = inspect(folder, verifier)
    keys = [f.key for f in findings(ins)]
    assert keys == ["eagle_aux_hidden_state_layer_ids", "config.json"], keys
    assert "eagle_config" in findings(ins)[1].vllm
    assert_fixed_as_trained(folder, fix(ins, tmp_path / "fixed", verifier), verifier, d.state_dict())


def test_vllm_reading_rules():
    """Model Runner V2's layer ids (sorted, deduplicated, its default for L layers) and the speculators format's
    norm_before_residual default."""
    ids, source = vllm_layer_ids({}, 4)
    assert ids == [1, 2] and source.startswith("vLLM's default")  # (2, 2, 1): two features for a 3-wide fc
    assert vllm_layer_ids({"eagle_aux_hidden_state_layer_ids": [3, 1, 2]}, 8)[0] == [1, 2, 3]
    assert vllm_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, 8)[0] == [2, 4, 5]
    assert vllm_flags({"speculators_config": {}})["norm_before_residual"] is True
    assert vllm_flags({})["norm_before_residual"] is False
    assert vllm_flags({"eagle_config": {"norm_before_fc": True}})["norm_before_fc"] is True


def test_command(verifier, tmp_path, capsys):
    folder = specforge_folder(drafter(verifier), tmp_path / "sf")
    args = ["--verifier", str(verifier.path), "--draft", str(folder)]
    assert peer_folder.main(args) == 1
    out = capsys.readouterr().out
    assert "FINDING eagle_aux_hidden_state_layer_ids: vLLM reads [2, 4, 5]" in out and "1 finding(s)" in out
    assert peer_folder.main([*args, "--fix", str(tmp_path / "fixed")]) == 0
    assert f"wrote {tmp_path / 'fixed'}: 1 fix(es)" in capsys.readouterr().out
    assert peer_folder.main(["--verifier", str(verifier.path), "--draft", str(tmp_path / "fixed")]) == 0
    assert peer_folder.main([*args, "--layer-ids", "1,2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --layer-ids 1,2: expected three distinct layer ids"


def test_a_drafter_for_another_verifier_is_refused_unless_retargeted(verifier, tmp_path, capsys):
    """Our export records its verifier: import-peer with another verifier of the same shapes (other weights) names
    both fingerprints and writes nothing; --retarget takes it as meant for this one."""
    other = Verifier.from_pretrained(save_tiny_verifier(tmp_path / "other", num_layers=L, seed=1))
    folder = export_eagle(drafter(verifier), tmp_path / "ours", verifier)
    args = ["--verifier", str(other.path), "--draft", str(folder), "--fix", str(tmp_path / "fixed")]
    capsys.readouterr()  # the set-up's progress bars
    assert peer_folder.main(args) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # (transformers' loading bar above it)
    assert line.startswith("error: --draft") and verifier.describe()["fingerprint"] in line
    assert other.describe()["fingerprint"] in line and "--retarget" in line
    assert not (tmp_path / "fixed").exists()
    assert peer_folder.main([*args, "--retarget"]) == 0 and (tmp_path / "fixed" / "config.json").is_file()


def test_a_fix_never_drops_trained_lm_head_rows(verifier, tmp_path):
    """d2t shorter than the trained lm_head (150 of 200 draft ids): the fix would drop 50 trained rows, so it is
    refused with the reason, and nothing is written."""
    counts = torch.randint(0, 100, (verifier.vocab_size,), generator=torch.Generator().manual_seed(0))
    d = build_drafter(verifier, EagleConfig(layer_ids=[1, 3, 6], draft_vocab_size=200), token_counts=counts)
    folder = export_eagle(d, tmp_path / "ours", verifier)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"][:150].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(PeerFolderError, match=r"d2t maps 150 draft ids but lm_head.weight has 200 rows"):
        fix(inspect(folder, verifier), tmp_path / "fixed", verifier)
    assert not (tmp_path / "fixed").exists()


def test_a_sliding_window_is_read_carried_and_its_count_noted(verifier, tmp_path):
    """A speculators checkpoint of a windowed EAGLE-3: vLLM's reading and the trained one hold the window, the fix
    keeps it (our engine then decodes windowed, as vLLM serves), a note says speculators' trainer counts the window
    of later draft steps from another position; a window dropped from our own export is a finding."""
    d = drafter(verifier)
    d.cfg.sliding_window = 6
    folder = speculators_folder(d, verifier, tmp_path / "sp", dtype=torch.float32)
    ins = inspect(folder, verifier)
    assert (ins.served.sliding_window, ins.trained.sliding_window) == (6, 6) and findings(ins) == []
    assert any("sliding_window 6: speculators' EAGLE-3 trainer windows draft step k" in n for n in ins.notes)
    out = fix(ins, tmp_path / "fixed", verifier)
    assert load_eagle(out, verifier).cfg.sliding_window == 6
    assert inspect(out, verifier).served.drafter(verifier).cfg.sliding_window == 6
    ours = export_eagle(d, tmp_path / "ours", verifier)
    config = json.loads((ours / "config.json").read_text())
    del config["layer_types"], config["sliding_window"]
    (ours / "config.json").write_text(json.dumps(config))
    ins = inspect(ours, verifier)
    lines = {f.key: f for f in findings(ins)}
    assert {"config.json", "sliding_window"} <= set(lines)
    assert (lines["sliding_window"].vllm, lines["sliding_window"].trained) == ("none (full attention)", "6")
    assert load_eagle(fix(ins, tmp_path / "refixed", verifier), verifier).cfg.sliding_window == 6
