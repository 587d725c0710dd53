"""The `eagle` method end to end: EAGLE-1 and EAGLE-3 exports loaded by the engine, chain and EAGLE-2 dynamic tree.

Greedy output equals Hugging Face greedy decoding (Llama, Qwen2, Mistral; batch 1 and ragged 3) with drafters that
are right part of the time (`tests.utils.fit_eagle`: least-squares fc, scaled-down random layer); the dynamic tree
equals a slow reference that reruns the drafter without a cache for every candidate; the drafter's KV cache after
rejections equals a fresh forward over the committed tokens; sampling at T=1 is lossless (chi-square).
"""

import functools

import pytest
import torch

from draftheads.eval import SpeculativeDecoder, build_decoder
from draftheads.eval.drafters import make_drafter
from draftheads.eval.engine.protocol import Sampling
from draftheads.models.export import export_eagle
from draftheads.models.verifier import Verifier
from tests.utils import FAMILIES, fit_eagle, greedy_corpus, hf_greedy, peaked_with_references

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 24
PROMPTS = {1: [[5, 77, 31, 200, 9, 77, 31]], 3: [[5, 77, 31, 200, 9, 77, 31], [42], [8, 8, 120, 3, 64, 19, 250, 7,
                                                                                     120, 3, 64]]}
MODES = {"chain": dict(chain=4), "tree": dict(depth=4, top_k=3, total_tokens=10)}


def fitted(model, verifier, version, seed=1):
    """A partially right drafter fitted on the verifier's greedy continuations of the test prompts and a few others
    (EAGLE-3 with a 200-token draft vocabulary, so the d2t map is exercised)."""
    g = torch.Generator().manual_seed(seed)
    prompts = PROMPTS[3] + torch.randint(3, model.config.vocab_size, (8, 6), generator=g).tolist()
    corpus = greedy_corpus(model, prompts, 32)
    return fit_eagle(verifier, version, corpus, draft_vocab_size=200 if version == 3 else None)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per (family, version): the peaked verifier, HF greedy references and the exported drafter folder."""
    @functools.cache
    def get(family, version):
        model, verifier, refs = peaked_with_references(family, [p for ps in PROMPTS.values() for p in ps], MAX_NEW)
        folder = tmp_path_factory.mktemp(f"eagle-{family}-{version}")
        export_eagle(fitted(model, verifier, version), folder, verifier)
        return model, verifier, refs, folder

    return get


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(exported, family, version, mode):
    model, verifier, refs, folder = exported(family, version)
    dec = SpeculativeDecoder(verifier, make_drafter("eagle", verifier, str(folder), **MODES[mode]), "eagle")
    accepted = []
    for batch, prompts in PROMPTS.items():
        out = dec.generate(prompts, MAX_NEW)
        assert out.output_ids == [refs[tuple(p)] for p in prompts], (family, version, mode, batch)
        accepted += [a for row in out.stats.accepted for a in row]
        assert out.stats.lossless
    # Right part of the time: some drafts accepted, some steps stop short of the deepest node.
    depth = dec.drafter.max_depth
    assert sum(a > 0 for a in accepted) >= 3 and any(a < depth for a in accepted), accepted
    assert 1.2 < 1 + sum(accepted) / len(accepted) < depth + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_first_token_from_the_prefill_is_still_greedy(exported, family):
    """vLLM's convention (the prefill picks the first token, drafting starts after it) changes no output."""
    model, verifier, refs, folder = exported(family, 3)
    dec = SpeculativeDecoder(verifier, make_drafter("eagle", verifier, str(folder), chain=3), "eagle",
                             first_token="prefill")
    for batch, prompts in PROMPTS.items():
        assert dec.generate(prompts, MAX_NEW).output_ids == [refs[tuple(p)] for p in prompts], (family, batch)


def test_dynamic_tree_beats_the_chain(exported):
    """Same drafter, same number of drafter forwards per step: the dynamic tree accepts more per step."""
    _, verifier, _, folder = exported("llama", 1)
    tau = {}
    for mode, options in MODES.items():
        dec = SpeculativeDecoder(verifier, make_drafter("eagle", verifier, str(folder), **options), "eagle")
        tau[mode] = dec.generate(PROMPTS[3], MAX_NEW, eos_token_id=None).stats.tau
    assert tau["tree"] > tau["chain"], tau


def test_default_is_the_dynamic_tree_and_folders_resolve(tmp_path, tiny_verifier_dirs):
    """from_pretrained with a verifier folder and an EAGLE-3 export folder; default options = dynamic tree."""
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["qwen2"])
    export_eagle(fitted(verifier.model, verifier, 3), tmp_path / "e3", verifier)
    dec = build_decoder(tiny_verifier_dirs["qwen2"], draft=tmp_path / "e3", method="eagle")
    d = dec.drafter.describe()
    assert d["eagle_version"] == 3 and d["depth"] == 6 and d["top_k"] == 4 and d["total_tokens"] == 16
    assert not dec.drafter.chain and dec.drafter.layer_ids == tuple(verifier.default_eagle3_layers())
    prompt = PROMPTS[1][0]
    assert dec.generate([prompt], 16).output_ids == [hf_greedy(dec.verifier.model, prompt, 16, eos_token_id=2)]


# ---- the dynamic tree against a slow reference ---------------------------------------------------------------------
def slow_dynamic_tree(drafter, verifier, ids: list[int], depth: int, top_k: int, total: int):
    """EAGLE-2 by brute force for one row: committed ids[:-1], root ids[-1]. Every candidate's children come from
    an uncached drafter forward over the whole pair sequence. Returns (tokens, parents) as lists, nodes 1..N."""
    committed = torch.tensor([ids[:-1]])
    feats = verifier.features(committed, layer_ids=drafter.feature_layers)
    prefix_hidden = drafter.project_features(feats.layers if drafter.version == 3 else [feats.final])[0]  # (L, H)
    prefix_ids = ids[1:]  # pairs (x_{t+1}, f_t)

    def outputs(path_ids, path_hidden):
        """The drafter's output at the last pair of prefix + path (no cache, causal)."""
        x = torch.tensor([prefix_ids + path_ids])
        h = torch.cat([prefix_hidden] + path_hidden)[None]
        out, _ = drafter(x, h)
        return out[0, -1:]  # (1, H)

    def children(out):
        logp = torch.log_softmax(drafter.logits(out[None]).float(), -1)[0, 0]
        lp, idx = logp.topk(top_k)
        return drafter.to_target_ids(idx).tolist(), lp.tolist()

    # candidate: (token, score, parent candidate, path ids, hidden fed to each path pair)
    root_out = outputs([], [])
    toks, lps = children(root_out)
    cands = [(t, s, -1, [t], [root_out]) for t, s in zip(toks, lps)]
    frontier = list(range(top_k))
    for d in range(1, depth):
        level = []
        for c in frontier:
            tok, score, _, path, hidden = cands[c]
            out = outputs(path, hidden)
            for t, lp in zip(*children(out)):
                level.append((t, score + lp, c, path + [t], hidden + [out]))
        first = len(cands)
        cands += level
        order = sorted(range(len(level)), key=lambda i: -level[i][1])
        frontier = [first + i for i in order[:top_k]]
    keep = sorted(sorted(range(len(cands)), key=lambda i: -cands[i][1])[:total])  # stable: ties keep order
    node = {c: i + 1 for i, c in enumerate(keep)}
    return [cands[c][0] for c in keep], [node.get(cands[c][2], 0) for c in keep]


@pytest.mark.parametrize("version", [1, 3])
def test_dynamic_tree_matches_slow_reference(exported, version):
    model, verifier, _, folder = exported("llama", version)
    drafter = make_drafter("eagle", verifier, str(folder), depth=4, top_k=3, total_tokens=12)
    dec = SpeculativeDecoder(verifier, drafter, "eagle")
    sampling = Sampling()
    prompts = PROMPTS[3]
    with torch.inference_mode():
        state = dec.begin(prompts, 16, sampling)
        for step in range(3):  # the first draft, then drafts after accepted / rejected steps
            draft = dec.draft(state, sampling)
            for b in range(len(prompts)):
                L = state.lengths_host[b]
                if L == 0:  # a one-token prompt before its first step: nothing to draft from
                    continue
                ids = state.tokens[b, : L + 1].tolist()
                with torch.no_grad():
                    tokens, parents = slow_dynamic_tree(drafter.model, verifier, ids, 4, 3, 12)
                assert draft.tokens[b].tolist() == tokens, (step, b)
                assert draft.tree.parents[b, 1:].tolist() == parents, (step, b)
            out = dec.verify(state, draft)
            acc = dec.accept(draft, out, sampling)
            committed = dec.commit(state, draft, acc, out)
            dec.drafter.observe(state, committed)
            state.lengths_host = state.lengths.tolist()


# ---- the drafter's own KV cache ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("version", [1, 3])
def test_drafter_cache_after_rejections_equals_a_fresh_forward(exported, version, mode):
    """After every step (rejections included), the drafter's cache over the committed positions equals one
    uncached drafter forward over the committed pairs, and its last output is that forward's last output."""
    model, verifier, _, folder = exported("mistral", version)
    drafter = make_drafter("eagle", verifier, str(folder), **MODES[mode])
    dec = SpeculativeDecoder(verifier, drafter, "eagle")
    sampling = Sampling()
    prompts = PROMPTS[3]
    rejected = 0
    with torch.inference_mode():
        state = dec.begin(prompts, 20, sampling)
        for _ in range(6):
            rows = dec.step(state, sampling)  # per row: [accepted, root, accepted tokens..., next token]
            rejected += sum(row[0] < drafter.max_depth for row in rows)
            for b in range(len(prompts)):
                L = state.lengths_host[b]
                ids = state.tokens[b, : L + 1]
                feats = verifier.features(ids[None, :L], layer_ids=drafter.model.feature_layers)
                hidden = drafter.model.project_features(feats.layers if version == 3 else [feats.final])
                out, (k, v) = drafter.model(ids[None, 1:], hidden)
                torch.testing.assert_close(drafter.cache_k[b: b + 1, :, :L], k, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(drafter.cache_v[b: b + 1, :, :L], v, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(drafter._hidden[b], out[0, -1:], atol=1e-5, rtol=1e-4)
    assert rejected > 0


# ---- options -------------------------------------------------------------------------------------------------------
def test_option_errors(exported):
    _, verifier, _, folder = exported("llama", 1)
    with pytest.raises(ValueError, match="total_tokens=100; expected 1..21"):
        make_drafter("eagle", verifier, str(folder), depth=3, top_k=3, total_tokens=100)
    with pytest.raises(ValueError, match="chain=K only"):
        make_drafter("eagle", verifier, str(folder), tree_sampling="sample")
    with pytest.raises(ValueError, match="no option.*num_steps"):
        make_drafter("eagle", verifier, str(folder), num_steps=3)
    with pytest.raises(TypeError, match="export folder or an EagleDrafter"):
        make_drafter("eagle", verifier, 3)


@pytest.mark.parametrize("options", [dict(chain=3), dict(chain=3, tree_sampling="topk"), MODES["tree"]],
                         ids=["chain-sample", "chain-topk", "tree"])
def test_sampling_ragged_batch_is_reproducible(exported, options):
    """T=0.8, top-p 0.9 on a ragged batch: runs, reproducible by seed, and lossless."""
    _, verifier, _, folder = exported("qwen2", 3)
    dec = SpeculativeDecoder(verifier, make_drafter("eagle", verifier, str(folder), **options), "eagle")
    a = dec.generate(PROMPTS[3], 16, temperature=0.8, top_p=0.9, seed=5)
    b = dec.generate(PROMPTS[3], 16, temperature=0.8, top_p=0.9, seed=5)
    assert a.output_ids == b.output_ids and a.stats.lossless
    assert all(1 <= len(o) <= 16 for o in a.output_ids)
