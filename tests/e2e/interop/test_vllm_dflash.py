"""Our DFlash exports in real vLLM (the CPU build of 0.32 in .venv-vllm; method "dflash", enforce_eager).

For a Llama, a Qwen2 and a Qwen3 verifier, z-lab's layout (`speculative_config={"method": "dflash", "model": FOLDER,
"num_speculative_tokens": 3}`), and for Qwen2 and Qwen3 the speculators format served as `LLM(model=FOLDER)`; one
batch of one prompt and one of three prompts of different lengths:
  - vLLM's greedy outputs equal plain greedy decoding of the verifier;
  - vLLM's accepted draft tokens, per request and per verification step (and its totals and per-position
    counters), equal our engine's exactly, our engine drafting the same block of 4 with the first token from the
    prefill as vLLM does.
The drafters are trained briefly on the verifiers' own continuations, so drafts from every mask position are
accepted: a layer id off by one, a missed +1, a norm left out or a causal mask where the block is bidirectional
changes the counts. `draftheads serve-check` passes on both layouts and fails, naming the field, on an export whose
target_layer_ids were edited in config.json after training.
"""

from __future__ import annotations

import json

import pytest

from draftheads.eval import build_decoder
from draftheads.eval.interop import serve_check
from draftheads.eval.interop.vllm_peer import VllmCase, run_vllm
from draftheads.models.dflash import DFlashConfig, build_drafter
from draftheads.models.export import export_dflash
from draftheads.models.verifier import Verifier
from tests.e2e.interop.test_vllm import FIT, PROMPTS, SIZE
from tests.utils import greedy_corpus, hf_greedy, peaked_model, save_tiny_verifier_with_tokenizer, \
    train_eagle_briefly

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]

K, MAX_NEW = 3, 32
OWN_VOCAB = 96  # the own-lm_head case's draft vocabulary (of the verifier's SIZE vocab_size)
BATCHES = [PROMPTS[:1], PROMPTS]


def trained_drafter(verifier, corpus, draft_vocab_size=None):
    """One DFlash layer reading the outputs of verifier layers 0 and 2, block 4, trained a few steps; with
    `draft_vocab_size`, its own lm_head over the corpus's most frequent tokens."""
    import torch

    torch.manual_seed(0)
    cfg = DFlashConfig(num_hidden_layers=1, block_size=K + 1, target_layer_ids=[0, 2], mask_token_id=0,
                       num_anchors=64, draft_vocab_size=draft_vocab_size)
    counts = torch.bincount(torch.tensor([t for row in corpus for t in row]), minlength=verifier.vocab_size)
    return train_eagle_briefly(build_drafter(verifier, cfg, token_counts=counts), verifier, corpus, steps=20,
                               lr=1e-2)


@pytest.fixture(scope="module")
def interop(tmp_path_factory, vllm_ready):
    root = tmp_path_factory.mktemp("interop-dflash")
    cases, ours, references = [], {}, {}
    for family in ("llama", "qwen2", "qwen3"):  # qwen2: vLLM serves it (SGLang 0.5.23 cannot, models.export)
        # Qwen2's seed-0 verifier leaves the 20-step drafter 5 accepted drafts over both batches, too few to compare
        # counts by; its seed 2 gives 27 (3 whole blocks)
        model = peaked_model(family, seed=2 if family == "qwen2" else 0, **SIZE)
        vdir = root / family / "verifier"
        model.save_pretrained(vdir, safe_serialization=True)
        verifier = Verifier.from_pretrained(vdir)
        corpus = greedy_corpus(verifier.model, FIT, 40)
        drafter = trained_drafter(verifier, corpus)
        references[family] = {tuple(p): hf_greedy(verifier.model, p, MAX_NEW) for p in PROMPTS}
        engines = ["vllm", "vllm-own-head"] if family == "llama" else ["vllm", "speculators"]
        for engine in engines:
            name = f"{family}-dflash-{engine}"
            if engine == "vllm-own-head":  # its own lm_head over a pruned vocabulary: lm_head, d2t in the folder
                drafter, engine = trained_drafter(verifier, corpus, draft_vocab_size=OWN_VOCAB), "vllm"
            folder = export_dflash(drafter, root / family / name, verifier, engine=engine)
            cases.append(VllmCase(name, str(vdir), str(folder), "dflash", batches=BATCHES, k=K, max_tokens=MAX_NEW,
                                  serve_drafter=engine == "speculators"))
            dec = build_decoder(verifier, draft=str(folder), method="dflash", first_token="prefill")
            ours[name] = [dec.generate(batch, MAX_NEW, eos_token_id=None) for batch in BATCHES]
    result = run_vllm(cases)
    return {"ours": ours, "vllm": {c["name"]: c for c in result["cases"]}, "references": references}


@pytest.mark.parametrize("name", ["llama-dflash-vllm", "llama-dflash-vllm-own-head", "qwen2-dflash-vllm",
                                  "qwen2-dflash-speculators", "qwen3-dflash-vllm", "qwen3-dflash-speculators"])
def test_vllm_decodes_like_plain_greedy_and_accepts_what_we_accept(interop, name):
    vllm = interop["vllm"][name]
    assert vllm["ok"], f"vLLM refused {name}: {vllm.get('error')}\n{vllm.get('traceback')}"
    refs = interop["references"][name.split("-")[0]]
    for batch, ours, theirs in zip(BATCHES, interop["ours"][name], vllm["batches"]):
        want = [refs[tuple(p)] for p in batch]
        assert theirs["outputs"] == want, f"{name}: vLLM's output is not plain greedy decoding"
        assert ours.output_ids == want
        assert theirs["per_step_accepted"] == ours.stats.accepted, name  # per request, per verification step
        steps = [a for row in ours.stats.accepted for a in row]
        assert theirs["metrics"]["vllm:spec_decode_num_accepted_tokens"] == sum(steps)
        assert theirs["metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"] == \
            [sum(a > i for a in steps) for i in range(K)]
        assert theirs["metrics"]["vllm:spec_decode_num_drafts"] == len(steps)
    steps = [a for o in interop["ours"][name] for row in o.stats.accepted for a in row]
    assert sum(steps) >= 10 and sum(a == K for a in steps) >= 2, \
        f"{name}: too few accepted drafts ({sum(steps)}) for the comparison to mean much"


def test_serve_check_passes_dflash_exports_and_fails_an_edited_one(tmp_path, capsys, vllm_ready):
    from transformers import AutoTokenizer

    from draftheads.data.prompts import load_prompts, prompt_ids

    vdir = save_tiny_verifier_with_tokenizer(tmp_path / "verifier", "qwen3", initializer_range=0.1, **SIZE)
    verifier = Verifier.from_pretrained(vdir)
    tokenizer = AutoTokenizer.from_pretrained(vdir)
    prompts = [prompt_ids(p, tokenizer) for p in load_prompts("humaneval", 3)]
    drafter = trained_drafter(verifier, greedy_corpus(verifier.model, prompts, 40))
    good = export_dflash(drafter, tmp_path / "dflash", verifier)
    spec = export_dflash(drafter, tmp_path / "speculators", verifier, engine="speculators")
    own = export_dflash(trained_drafter(verifier, greedy_corpus(verifier.model, prompts, 40),
                                        draft_vocab_size=verifier.vocab_size // 2), tmp_path / "own-head", verifier)
    broken = export_dflash(drafter, tmp_path / "broken", verifier)  # target layers edited after training
    config = json.loads((broken / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 2]
    (broken / "config.json").write_text(json.dumps(config))
    code = serve_check.main(["--verifier", str(vdir), "--draft", str(good), str(spec), str(own), str(broken),
                             "--num-prompts", "3", "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert code == 1, out
    for folder in (good, spec, own):
        line = next(x for x in out.splitlines() if x.startswith(f"VERDICT {folder}:"))
        assert line.startswith(f"VERDICT {folder}: PASS"), out
    line = next(x for x in out.splitlines() if x.startswith(f"VERDICT {broken}:"))
    assert line.startswith(f"VERDICT {broken}: FAIL - config.json disagrees with how it was trained "
                           "(target_layer_ids"), out
    section = out.split(f"== {broken} ")[1].split("VERDICT")[0]
    assert "DISAGREES target_layer_ids: vLLM reads [1, 2] (config.json dflash_config.target_layer_ids)" in section
    assert "accepted per step: DIFFERENT" not in section, section  # our reading of vLLM's reading holds


def test_speculators_library_reads_our_dflash_export_with_its_own_classes(tmp_path, vllm_ready):
    """`SpeculatorModel.from_pretrained(FOLDER, config=its config with sdpa attention)` on our speculators-format
    DFlash export (speculators 0.9 in .venv-vllm, its own DFlashDraftModel; the verifier's embedding and lm_head
    loaded by it from the path the folder names): its training forward over anchored blocks, given the verifier's
    features, computes our drafter's block logits to float tolerance, for several anchors of one row at once (each
    block reading the context strictly before its anchor). Full-attention layers; the layer ids it would read are
    not exercised here (vLLM's conversion of the format is, above)."""
    import torch

    from draftheads.eval.interop.vllm_peer import SpeculatorsDFlashLogits

    model = peaked_model("qwen3", **SIZE)
    vdir = tmp_path / "verifier"
    model.save_pretrained(vdir, safe_serialization=True)
    verifier = Verifier.from_pretrained(vdir)
    drafter = trained_drafter(verifier, greedy_corpus(verifier.model, FIT, 40))
    folder = export_dflash(drafter, tmp_path / "speculators", verifier, engine="speculators")
    ids = torch.tensor([PROMPTS[2] + FIT[-1] + PROMPTS[0]])
    anchors = [1, 4, 5, ids.shape[1] - drafter.block_size - 1]
    assert anchors == sorted(set(anchors)) and anchors[-1] < ids.shape[1] - drafter.block_size
    hidden = torch.cat(verifier.features(ids, layer_ids=drafter.feature_layers).layers, -1)

    def ours(at):
        with torch.no_grad():
            h = drafter.anchored_hidden(ids, hidden, torch.tensor([at]), torch.ones(1, len(at), dtype=torch.bool))
            return drafter.logits(h)[0].flatten(0, 1)  # (A*N, V)

    case = SpeculatorsDFlashLogits("qwen3-dflash-speculators", str(folder), ids[0].tolist(), hidden[0].tolist(),
                                   anchors)
    result = run_vllm([case])["cases"][0]
    assert result["ok"], f"{result.get('error')}\n{result.get('traceback')}"
    assert result["model_class"] == "DFlashDraftModel" and result["block_size"] == drafter.block_size
    theirs = torch.tensor(result["logits"])
    want = ours(anchors)
    assert theirs.shape == want.shape
    torch.testing.assert_close(theirs, want, atol=1e-4, rtol=1e-4)
    # the comparison can fail: the same blocks one position later differ by far more than the tolerance
    assert (ours([a + 1 for a in anchors]) - theirs).abs().max() > 1e-2
