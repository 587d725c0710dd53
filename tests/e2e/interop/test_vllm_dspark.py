"""Our DSpark exports in vLLM's own model class (the CPU build of 0.32 in .venv-vllm): Qwen3DSparkForCausalLM.

vLLM's CPU build cannot serve DSpark (only its V2 GPU runner drafts it, and V2 needs Triton with a CPU backend; the
case records vLLM's refusal), so the class is constructed outside a server from the SpeculativeConfig vLLM builds
for {"method": "dspark", "model": FOLDER}, loaded through its own load_weights, and run forward
(eval/interop/vllm_dspark.py). For a DSpark drafter trained a few steps on a Qwen3 verifier, in vLLM's layout (with
the confidence head reading the Markov embedding), with its own pruned lm_head (the d2t map, the Markov bias in the
draft vocabulary, a confidence head on the hidden state only) and in speculators' dspark format:
  - every parameter of vLLM's model is written (embed_tokens / lm_head: shared from the verifier, as vLLM does)
    and no tensor of ours is skipped;
  - on one block after a context, its block hidden states, base logits, Markov bias and confidence equal ours to
    fp32 tolerance, and its greedy left-to-right chain equals our engine's drafts;
  - a copy of the export with three weights nudged (a layer's down_proj, markov_w2, the confidence bias) loads as
    fully and differs from ours in each of the four, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftheads.eval.interop.vllm_peer import VllmDSparkForward, run_vllm
from draftheads.models.dflash import DFlashConfig, build_drafter
from draftheads.models.export import export_dflash
from draftheads.models.verifier import Verifier
from tests.e2e.interop.test_vllm import FIT, PROMPTS, SIZE
from tests.utils import greedy_corpus, peaked_model, train_eagle_briefly

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]

K = 3
NUDGED = ("layers.0.mlp.down_proj.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias")
CASES = {"vllm": {}, "vllm-own-head": {"draft_vocab_size": 96, "confidence_with_markov": False},
         "speculators": {}}


def trained_dspark(verifier, corpus, **extra):
    torch.manual_seed(0)
    cfg = DFlashConfig(num_hidden_layers=1, block_size=K + 1, target_layer_ids=[0, 2], mask_token_id=1,
                       num_anchors=64, markov_rank=16, **extra)
    counts = torch.bincount(torch.tensor([t for row in corpus for t in row]), minlength=verifier.vocab_size)
    return train_eagle_briefly(build_drafter(verifier, cfg, token_counts=counts), verifier, corpus, steps=20,
                               lr=1e-2)


def ours(drafter, features, block, prev):
    """Our drafter on the block: hidden (N, H), base logits (K, Vd), Markov bias, confidence, greedy chain."""
    with torch.no_grad():
        n, N = features.shape[1], block.shape[0]
        hidden = drafter(torch.arange(n + N)[None], None, drafter.embed(block[None]), features)[0]
        drafted = hidden[1:]
        embeds = drafter.markov_head.embed(prev)
        confidence = drafter.confidence(drafted, prev) if hasattr(drafter, "confidence_head") else None
        chain, _ = drafter.draft_block(drafted[None], block[:1], lambda logits, k: logits.argmax(-1))
        return {"hidden": hidden, "base_logits": drafter._base_logits(drafted),
                "markov_bias": drafter.markov_head.bias(embeds), "confidence": confidence, "chain": chain[0]}


@pytest.fixture(scope="module")
def dspark(tmp_path_factory, vllm_ready):
    root = tmp_path_factory.mktemp("interop-dspark")
    model = peaked_model("qwen3", **SIZE)
    vdir = root / "verifier"
    model.save_pretrained(vdir, safe_serialization=True)
    verifier = Verifier.from_pretrained(vdir)
    corpus = greedy_corpus(verifier.model, FIT, 40)
    ids = torch.tensor(PROMPTS[2] + FIT[-1])
    features = torch.cat(verifier.features(ids[None], layer_ids=[1, 3]).layers, -1)  # (1, n, 2H)
    anchor = int(verifier.model(ids[None]).logits[0, -1].argmax())  # the verified token after the context
    block = torch.tensor([anchor] + [1] * K)
    cases, want = [], {}
    for name, extra in CASES.items():
        drafter = trained_dspark(verifier, corpus, **extra)
        engine = "speculators" if name == "speculators" else "vllm"
        folder = export_dflash(drafter, root / name, verifier, engine=engine)
        chain = ours(drafter, features, block, block[:1].repeat(K))["chain"]
        prev = torch.cat([block[:1], chain[:-1]])  # the chain's own previous tokens
        want[name] = ours(drafter, features, block, prev)
        cases.append(VllmDSparkForward(name, str(vdir), str(folder), K, features[0].tolist(), block.tolist(),
                                       prev.tolist()))
        if name == "vllm":  # the control: the same export with three weights nudged
            nudged = root / "nudged"
            nudged.mkdir()
            (nudged / "config.json").write_text((folder / "config.json").read_text())
            tensors = load_file(folder / "model.safetensors")
            for key in NUDGED:
                tensors[key] = tensors[key] + 0.05 * torch.randn_like(tensors[key])
            save_file(tensors, nudged / "model.safetensors")
            want["nudged"] = want[name]
            cases.append(VllmDSparkForward("nudged", str(vdir), str(nudged), K, features[0].tolist(),
                                           block.tolist(), prev.tolist()))
    result = run_vllm(cases)
    return {"ours": want, "vllm": {c["name"]: c for c in result["cases"]}}


@pytest.mark.parametrize("name", [*CASES, "nudged"])
def test_vllm_loads_every_parameter_and_skips_none_of_ours(dspark, name):
    theirs = dspark["vllm"][name]
    assert theirs["ok"], f"{name}: {theirs.get('error')}\n{theirs.get('traceback')}"
    assert theirs["model_class"] == "Qwen3DSparkForCausalLM"
    assert theirs["unwritten"] == [], f"{name}: vLLM parameters never written: {theirs['unwritten']}"
    assert theirs["skipped"] == [], f"{name}: our tensors vLLM's load_weights skipped: {theirs['skipped']}"
    assert theirs["confidence_head"]
    # the CPU build refuses to serve it, for the reason the notes give
    assert "Model Runner V1 does not support: dspark speculative decoding" in theirs["serve_refusal"]


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_forward_equals_ours(dspark, name):
    theirs, want = dspark["vllm"][name], dspark["ours"][name]
    assert theirs["ok"], theirs.get("error")
    for key in ("hidden", "base_logits", "markov_bias", "confidence"):
        torch.testing.assert_close(torch.tensor(theirs[key]), want[key].float(), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, key=key: f"{name} {key}: {m}")
    assert theirs["chain"] == want["chain"].tolist(), f"{name}: vLLM's greedy Markov chain differs from ours"
    assert want["markov_bias"].abs().max() > 1e-3, "the Markov head trained to nothing: the comparison is empty"


def test_a_nudged_export_differs(dspark):
    theirs, want = dspark["vllm"]["nudged"], dspark["ours"]["nudged"]
    assert theirs["ok"], theirs.get("error")
    for key in ("hidden", "base_logits", "markov_bias", "confidence"):
        assert (torch.tensor(theirs[key]) - want[key].float()).abs().max() > 1e-3, key


def test_serve_check_says_it_cannot_serve_dspark_here(tmp_path, capsys):
    """serve-check names why a DSpark export is not served on this machine (both layouts), in its verdict line."""
    from draftheads.eval.interop import serve_check
    from tests.utils import save_tiny_verifier_with_tokenizer

    vdir = save_tiny_verifier_with_tokenizer(tmp_path / "verifier", "qwen3", **SIZE)
    verifier = Verifier.from_pretrained(vdir)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=1, block_size=K + 1, markov_rank=8))
    folders = [export_dflash(drafter, tmp_path / engine, verifier, engine=engine)
               for engine in ("vllm", "speculators")]
    code = serve_check.main(["--verifier", str(vdir), "--draft", *map(str, folders), "--num-prompts", "1",
                             "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 1, out
    for folder in folders:
        line = next(x for x in out.splitlines() if x.startswith(f"VERDICT {folder}:"))
        assert line.startswith(f"VERDICT {folder}: NOT JUDGED - not run in vLLM: a DSpark drafter (Markov head): "
                               "vLLM serves method dspark only with its V2 GPU model runner"), line


def test_speculators_library_reads_our_dspark_export_with_its_own_classes(tmp_path, vllm_ready):
    """speculators 0.9's own DSparkDraftModel (`SpeculatorModel.from_pretrained` on our speculators-format export,
    in .venv-vllm) runs its training forward over anchored blocks: its block logits, its Markov head's bias (the
    previous block token teacher-forced, the anchor first) and its confidence head's logits equal ours to float
    tolerance; the same blocks one position later differ."""
    from draftheads.eval.interop.vllm_peer import SpeculatorsDFlashLogits

    model = peaked_model("qwen3", **SIZE)
    vdir = tmp_path / "verifier"
    model.save_pretrained(vdir, safe_serialization=True)
    verifier = Verifier.from_pretrained(vdir)
    drafter = trained_dspark(verifier, greedy_corpus(verifier.model, FIT, 40))
    folder = export_dflash(drafter, tmp_path / "speculators", verifier, engine="speculators")
    ids = torch.tensor([PROMPTS[2] + FIT[-1] + PROMPTS[0]])
    N = drafter.block_size
    anchors = [1, 4, 5, ids.shape[1] - N - 1]
    hidden = torch.cat(verifier.features(ids, layer_ids=drafter.feature_layers).layers, -1)

    def ours(at):
        with torch.no_grad():
            h = drafter.anchored_hidden(ids, hidden, torch.tensor([at]), torch.ones(1, len(at), dtype=torch.bool))[0]
            prev = torch.stack([ids[0, [a] + list(range(a, a + N - 1))] for a in at])  # (A, N): anchor, then shifted
            embed = drafter.markov_head.embed(prev)
            return {"logits": drafter.logits(h).flatten(0, 1),
                    "markov_bias": drafter.markov_head.bias(embed).flatten(0, 1),
                    "confidence_logits": drafter.confidence_head(h, embed).flatten()}

    case = SpeculatorsDFlashLogits("qwen3-dspark-speculators", str(folder), ids[0].tolist(), hidden[0].tolist(),
                                   anchors)
    result = run_vllm([case])["cases"][0]
    assert result["ok"], f"{result.get('error')}\n{result.get('traceback')}"
    assert result["model_class"] == "DSparkDraftModel" and result["block_size"] == N
    want, moved = ours(anchors), ours([a + 1 for a in anchors])
    for key in ("logits", "markov_bias", "confidence_logits"):
        theirs = torch.tensor(result[key])
        torch.testing.assert_close(theirs, want[key], atol=1e-4, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
        assert (moved[key] - theirs).abs().max() > 1e-2, key  # the comparison can fail
