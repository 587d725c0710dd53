"""The `medusa` method end to end: exports loaded by the engine, static tree and chain, greedy equality with Hugging
Face (Llama, Qwen2, Mistral; batch 1 and ragged 3), lossless sampling (chi-square), typical acceptance (lossy, on
request), and Medusa-2 exports that bring a LoRA adapter for the verifier.

The heads are zero-initialised ResBlocks over a copy of the verifier's lm_head (`MedusaHeads.from_verifier`):
every head predicts the verifier's own next token, i.e. "the token after the root repeats the root", which these
peaked random verifiers do often but not always: a partially right drafter without training.
"""

import pytest
import torch

from draftheads.eval import SpeculativeDecoder, build_decoder
from draftheads.eval.drafters import make_drafter
from draftheads.eval.engine.acceptance import probs_from_logits, typical_threshold, typical_tree
from draftheads.eval.engine.tree import Tree
from draftheads.models.export import save_medusa
from draftheads.models.medusa import MedusaHeads, add_lora
from draftheads.models.verifier import Verifier
from tests.utils import FAMILIES, hf_greedy, peaked_model, save_tiny_verifier

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 24
PROMPTS = {1: [[5, 77, 31, 200, 9, 77, 31]], 3: [[5, 77, 31, 200, 9, 77, 31], [42], [8, 8, 120, 3, 64, 19, 250, 7,
                                                                                     120, 3, 64]]}
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]
RANK_ACCURACY = [[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1], [0.3, 0.1, 0.05]]
MODES = {"export-tree": {}, "chain": dict(chain=3), "budget": dict(tree_budget=6)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per family: the peaked verifier, HF greedy references and an exported Medusa-1 folder with a tree."""
    cache = {}

    def get(family):
        if family not in cache:
            model = peaked_model(family)
            verifier = Verifier(model)
            refs = {tuple(p): hf_greedy(model, p, MAX_NEW, eos_token_id=2) for ps in PROMPTS.values() for p in ps}
            folder = tmp_path_factory.mktemp(f"medusa-{family}")
            save_medusa(folder, MedusaHeads.from_verifier(verifier, num_heads=4), verifier, tree=TREE,
                        rank_accuracy=RANK_ACCURACY)
            cache[family] = (model, verifier, refs, folder)
        return cache[family]

    return get


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(exported, family, mode):
    model, verifier, refs, folder = exported(family)
    dec = SpeculativeDecoder(verifier, make_drafter("medusa", verifier, str(folder), **MODES[mode]), "medusa")
    accepted = []
    for batch, prompts in PROMPTS.items():
        out = dec.generate(prompts, MAX_NEW)
        assert out.output_ids == [refs[tuple(p)] for p in prompts], (family, mode, batch)
        accepted += [a for row in out.stats.accepted for a in row]
    depth = dec.drafter.max_depth
    assert sum(a > 0 for a in accepted) >= 3 and any(a < depth for a in accepted), accepted


@pytest.mark.parametrize("family", FAMILIES)
def test_first_token_from_the_prefill_is_still_greedy(exported, family):
    """vLLM's convention (the prefill picks the first token, drafting starts after it) changes no output."""
    model, verifier, refs, folder = exported(family)
    dec = SpeculativeDecoder(verifier, make_drafter("medusa", verifier, str(folder), chain=3), "medusa",
                             first_token="prefill")
    for batch, prompts in PROMPTS.items():
        assert dec.generate(prompts, MAX_NEW).output_ids == [refs[tuple(p)] for p in prompts], (family, batch)


def test_tree_sources(exported):
    _, verifier, _, folder = exported("llama")
    d = make_drafter("medusa", verifier, str(folder))
    assert d.paths == TREE and d.tree_source == "export" and d.num_draft_tokens == len(TREE) and d.max_depth == 4
    assert d.tree.is_chain is False
    chain = make_drafter("medusa", verifier, str(folder), chain=True)
    assert chain.paths == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)] and chain.tree.is_chain
    budget = make_drafter("medusa", verifier, str(folder), tree_budget=6)
    assert budget.num_draft_tokens == 6 and budget.tree_source.startswith("rank_accuracy")
    paths = make_drafter("medusa", verifier, str(folder), paths=[[0], [0, 2]])
    assert paths.paths == [(0,), (0, 2)] and paths.describe()["tree"] == [[0], [0, 2]]
    # heads in memory, no export: the chain of every head
    heads = MedusaHeads.from_verifier(verifier, num_heads=2)
    assert make_drafter("medusa", verifier, heads).paths == [(0,), (0, 0)]


def test_tree_tokens_are_each_heads_ranks(exported):
    """Node (r_1, ..., r_d) holds head d-1's rank-r_d token: checked against the heads run by hand."""
    _, verifier, _, folder = exported("qwen2")
    drafter = make_drafter("medusa", verifier, str(folder))
    dec = SpeculativeDecoder(verifier, drafter, "medusa")
    from draftheads.eval.engine.protocol import Sampling

    with torch.inference_mode():
        state = dec.begin(PROMPTS[3], 8, Sampling())
        draft = dec.draft(state, Sampling())
        logits = drafter.heads(drafter._hidden)  # (K, B, V)
    for b in range(3):
        for i, path in enumerate(TREE):
            ranked = logits[len(path) - 1, b].argsort(descending=True)
            assert int(draft.tokens[b, i]) == int(ranked[path[-1]])


# ---- typical acceptance (lossy) ------------------------------------------------------------------------------------
def slow_typical(tokens, parents, probs, epsilon, alpha):
    """Medusa's evaluate_posterior over every root-to-node path of one row: (accepted node, accepted length)."""
    N1 = len(parents)
    best, best_len, best_ll = 0, 0, -float("inf")
    for node in range(1, N1):
        path = []
        n = node
        while n > 0:
            path.append(n)
            n = parents[n]
        path = path[::-1]
        length, ll = 0, 0.0
        for n in path:
            q = probs[parents[n]]
            thr = min(epsilon, alpha * float(torch.exp((q * torch.log(q + 1e-5)).sum())))
            if float(q[tokens[n]]) <= thr:
                break
            length += 1
            ll += float(torch.log(q[tokens[n]]))
        if length == len(path) and (length > best_len or (length == best_len and ll > best_ll)):
            best, best_len, best_ll = node, length, ll
    return best, best_len


def test_typical_tree_matches_medusas_rule():
    gen = torch.Generator().manual_seed(0)
    tree = Tree.from_paths(TREE)
    B, N1, Vs = 64, tree.num_nodes, 8
    logits = torch.randn(B, N1, Vs, generator=gen) * 2
    probs = probs_from_logits(logits, 1.0)
    tokens = torch.randint(0, Vs, (B, N1 - 1), generator=gen)
    noise = torch.empty(B, Vs).exponential_(generator=gen)
    acc = typical_tree(tokens, tree, probs, noise, 0.09, 0.3)
    parents = tree.parents[0].tolist()
    for b in range(B):
        node, length = slow_typical([0] + tokens[b].tolist(), parents, probs[b], 0.09, 0.3)
        assert int(acc.num_accepted[b]) == length
        assert int(acc.path[b, length]) == node
        q = probs[b, node]
        assert q[acc.next_token[b]] > typical_threshold(q, 0.09, 0.3) or q[acc.next_token[b]] == q.max()
    assert acc.num_accepted.float().mean() > 0.3  # the rule does accept


def test_typical_acceptance_runs_and_is_flagged_lossy(exported):
    model, verifier, refs, folder = exported("llama")
    drafter = make_drafter("medusa", verifier, str(folder), acceptance="typical")
    assert drafter.typical == (0.09, 0.3) and drafter.describe()["acceptance"]["lossless"] is False
    dec = SpeculativeDecoder(verifier, drafter, "medusa")
    greedy = dec.generate(PROMPTS[3], MAX_NEW)  # T = 0: typical acceptance is greedy
    assert greedy.output_ids == [refs[tuple(p)] for p in PROMPTS[3]] and greedy.stats.lossless
    sampled = dec.generate(PROMPTS[3], MAX_NEW, temperature=0.7, seed=0)
    assert not sampled.stats.lossless and sampled.stats.to_dict()["lossless"] is False
    assert all(1 <= len(o) <= MAX_NEW for o in sampled.output_ids) and sampled.stats.tau >= 1
    lossless = SpeculativeDecoder(verifier, make_drafter("medusa", verifier, str(folder)), "medusa")
    assert lossless.generate(PROMPTS[3], MAX_NEW, temperature=0.7, seed=0).stats.lossless


# ---- Medusa-2 ------------------------------------------------------------------------------------------------------
def test_medusa2_export_brings_its_adapter(tmp_path):
    """The engine verifies with base + LoRA adapter: greedy output equals HF greedy of the adapted model, not of
    the base; loading the same export again does not merge twice."""
    base_dir = save_tiny_verifier(tmp_path / "base", "llama", seed=0, initializer_range=0.1)
    trained = Verifier.from_pretrained(base_dir)
    add_lora(trained, r=4, alpha=8, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trained.model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    save_medusa(tmp_path / "m2", MedusaHeads.from_verifier(trained, num_heads=3), trained, tree=TREE[:6])
    adapted = trained.model.merge_and_unload()

    dec = build_decoder(base_dir, draft=tmp_path / "m2", method="medusa")
    prompt = PROMPTS[1][0]
    want = hf_greedy(adapted, prompt, 16, eos_token_id=2)
    assert dec.generate([prompt], 16).output_ids == [want]
    base = Verifier.from_pretrained(base_dir)
    assert hf_greedy(base.model, prompt, 16, eos_token_id=2) != want  # the adapter matters
    again = make_drafter("medusa", dec.verifier, str(tmp_path / "m2"))  # same adapter: no second merge
    assert SpeculativeDecoder(dec.verifier, again, "medusa").generate([prompt], 16).output_ids == [want]


# ---- options -------------------------------------------------------------------------------------------------------
def test_option_errors(exported):
    _, verifier, _, folder = exported("llama")
    with pytest.raises(ValueError, match="at most one of paths, tree_budget, chain"):
        make_drafter("medusa", verifier, str(folder), chain=2, paths=[[0]])
    with pytest.raises(ValueError, match="chain=9; expected 1..4"):
        make_drafter("medusa", verifier, str(folder), chain=9)
    with pytest.raises(ValueError, match="depth 5, expected 1..4"):
        make_drafter("medusa", verifier, str(folder), paths=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0] * 5])
    with pytest.raises(ValueError, match="acceptance='loose'"):
        make_drafter("medusa", verifier, str(folder), acceptance="loose")
    heads = MedusaHeads.from_verifier(verifier, num_heads=2)
    with pytest.raises(ValueError, match="tree_budget needs"):
        make_drafter("medusa", verifier, heads, tree_budget=4)


@pytest.mark.parametrize("tree_sampling", ["sample", "topk"])
def test_sampling_ragged_batch_is_reproducible(exported, tree_sampling):
    _, verifier, _, folder = exported("mistral")
    dec = SpeculativeDecoder(verifier, make_drafter("medusa", verifier, str(folder), tree_sampling=tree_sampling),
                             "medusa")
    a = dec.generate(PROMPTS[3], 16, temperature=0.8, top_p=0.9, seed=5)
    b = dec.generate(PROMPTS[3], 16, temperature=0.8, top_p=0.9, seed=5)
    assert a.output_ids == b.output_ids and a.stats.lossless
    assert all(1 <= len(o) <= 16 for o in a.output_ids)
