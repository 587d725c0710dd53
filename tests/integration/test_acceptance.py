"""The acceptance math against slow, obviously-correct references, and its known statistics."""

import math

import pytest
import torch

from draftheads.eval.engine.acceptance import (
    greedy_chain,
    greedy_tree,
    probs_from_logits,
    sample,
    sample_chain,
    sample_tree,
)
from draftheads.eval.engine.tree import Tree, tree_attention_mask
from tests.utils import chi2_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- slow references: one row at a time, Python loops --------------------------------------------------------------
def children_of(parents: list[int], node: int) -> list[int]:
    return [j for j in range(1, len(parents)) if parents[j] == node]


def ref_greedy_tree(tokens, parents, logits):
    """tokens (N,), parents (N+1,), logits (N+1, V) for one row -> (a, path, next)."""
    N = len(tokens)
    target = [int(logits[i].argmax()) for i in range(N + 1)]
    best, best_path = 0, [0]

    def walk(node, path):
        nonlocal best, best_path
        depth = len(path) - 1
        if depth > len(best_path) - 1 or (depth == len(best_path) - 1 and node < best):
            best, best_path = node, list(path)
        for c in children_of(parents, node):
            if tokens[c - 1] == target[node]:
                walk(c, path + [c])

    walk(0, [0])
    return len(best_path) - 1, best_path, target[best]


def ref_sample_tree(tokens, parents, draft_probs, target_probs, uniform, noise):
    """One row of multi-candidate recursive rejection sampling, written as plainly as possible."""
    V = target_probs.shape[-1]
    node, path = 0, [0]
    q = target_probs[0].clone()
    while True:
        moved = False
        for c in children_of(parents, node):
            x = tokens[c - 1]
            p = draft_probs[c - 1] if draft_probs is not None else torch.nn.functional.one_hot(
                torch.tensor(x), V).float()
            if uniform[c - 1] * p[x] < q[x]:  # accept with probability min(1, q(x) / p(x))
                node, q, moved = c, target_probs[c].clone(), True
                path.append(c)
                break
            r = (q - p).clamp(min=0)  # rejected: the residual becomes the target for the next sibling
            q = r / r.sum().clamp_min(1e-30) if r.sum() > 0 else q
        if not moved:
            break
    return len(path) - 1, path, int((q / noise).argmax())


def random_tree(n, rng, chain=False):
    parents = [-1] + [i - 1 if chain else int(torch.randint(0, i, (1,), generator=rng)) for i in range(1, n + 1)]
    return parents


def random_case(B, N, V, rng, chain=False, with_probs=True, peak=3.0):
    parents = [random_tree(N, rng, chain) for _ in range(B)]
    tree = Tree.from_parents(torch.tensor(parents))
    tokens = torch.randint(0, V, (B, N), generator=rng)
    target = torch.softmax(peak * torch.randn(B, N + 1, V, generator=rng), -1)
    probs = torch.softmax(peak * torch.randn(B, N, V, generator=rng), -1) if with_probs else None
    uniform = torch.rand(B, N, generator=rng)
    noise = torch.empty(B, V).exponential_(generator=rng)
    return parents, tree, tokens, target, probs, uniform, noise


def padded(path, D):
    return path + [path[-1]] * (D + 1 - len(path))


# ---- trees -------------------------------------------------------------------------------------------------------
def test_tree_builders_and_mask():
    t = Tree.from_branching([2, 2, 1])
    assert t.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6]
    assert t.depth[0].tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert t.max_depth == 3 and not t.is_chain
    assert t.children[0, 0].tolist() == [1, 2] and t.children[0, 3].tolist() == [7, -1]
    assert t.ancestors[0, 9].nonzero()[:, 0].tolist() == [0, 2, 5, 9]
    c = Tree.chain(4, batch_size=2)
    assert c.is_chain and c.max_depth == 4 and c.parents.shape == (2, 5)
    p = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    assert p.parents[0].tolist() == [-1, 0, 0, 1, 1, 3]
    with pytest.raises(ValueError, match="parents"):
        Tree.from_parents(torch.tensor([-1, 1]))
    # Mask: prefix slots < base, then the ancestors' slots from base on.
    base = torch.tensor([3, 5])
    m = tree_attention_mask(base, t.expand(2).ancestors, window=20)
    assert m[0, 9].nonzero()[:, 0].tolist() == [0, 1, 2, 3 + 0, 3 + 2, 3 + 5, 3 + 9]
    assert m[1, 0].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 4, 5]


# ---- greedy ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chain", [True, False])
def test_greedy_matches_reference(chain):
    rng = torch.Generator().manual_seed(0)
    for trial in range(30):
        B, N, V = 4, int(torch.randint(1, 9, (1,), generator=rng)), 3  # V=3: matches are frequent
        parents, tree, tokens, target, _, _, _ = random_case(B, N, V, rng, chain=chain)
        logits = target.log()
        fast = greedy_tree(tokens, tree, logits)
        for b in range(B):
            a, path, nxt = ref_greedy_tree(tokens[b].tolist(), parents[b], logits[b])
            assert fast.num_accepted[b] == a
            assert fast.path[b].tolist() == padded(path, tree.max_depth)
            assert fast.next_token[b] == nxt


def test_greedy_chain_edges():
    V = 5
    logits = torch.zeros(2, 4, V)
    logits[:, torch.arange(4), torch.tensor([1, 2, 3, 4])] = 5.0  # argmax after node i is i+1
    draft = torch.tensor([[1, 2, 3], [0, 2, 3]])  # row 0: all accepted; row 1: first rejected
    acc = greedy_chain(draft, logits)
    assert acc.num_accepted.tolist() == [3, 0]
    assert acc.next_token.tolist() == [4, 1]  # bonus, correction
    assert acc.path.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]
    empty = greedy_chain(torch.zeros(2, 0, dtype=torch.long), logits[:, :1])
    assert empty.num_accepted.tolist() == [0, 0] and empty.next_token.tolist() == [1, 1]


# ---- sampling ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("with_probs", [True, False])
def test_sampling_matches_reference(chain, with_probs):
    rng = torch.Generator().manual_seed(1)
    for trial in range(25):
        B, N, V = 5, int(torch.randint(1, 8, (1,), generator=rng)), 4
        parents, tree, tokens, target, probs, u, noise = random_case(B, N, V, rng, chain, with_probs, peak=1.0)
        fast = sample_tree(tokens, tree, probs, target, u, noise)
        for b in range(B):
            a, path, nxt = ref_sample_tree(tokens[b].tolist(), parents[b], None if probs is None else probs[b],
                                           target[b], u[b], noise[b])
            assert fast.num_accepted[b] == a, (trial, b)
            assert fast.path[b].tolist() == padded(path, tree.max_depth)
            assert fast.next_token[b] == nxt


def test_sample_chain_equals_tree_loop_on_chains():
    rng = torch.Generator().manual_seed(2)
    parents, tree, tokens, target, probs, u, noise = random_case(64, 5, 4, rng, chain=True, peak=1.0)
    fast = sample_chain(tokens, probs, target, u, noise)
    # The tree loop, forced off its chain shortcut by a tree object that does not say it is a chain.
    loop_tree = Tree(tree.parents, tree.depth, tree.ancestors, tree.children, tree.max_depth, False)
    slow = sample_tree(tokens, loop_tree, probs, target, u, noise)
    assert torch.equal(fast.num_accepted, slow.num_accepted)
    assert torch.equal(fast.next_token, slow.next_token)
    assert torch.equal(fast.path, slow.path)


def test_sampling_edges_all_and_nothing_accepted():
    V = 4
    target = torch.zeros(1, 3, V)
    target[0, :, 1] = 1.0  # the verifier is certain of token 1 everywhere
    noise = torch.ones(1, V)
    u = torch.full((1, 2), 0.999)
    allin = sample_chain(torch.tensor([[1, 1]]), None, target, u, noise)
    assert allin.num_accepted.tolist() == [2] and allin.next_token.tolist() == [1]
    nothing = sample_chain(torch.tensor([[2, 1]]), None, target, torch.zeros(1, 2), noise)
    assert nothing.num_accepted.tolist() == [0] and nothing.next_token.tolist() == [1]  # q(2)=0: never accepted
    tree = Tree.from_branching([3])
    none_of = sample_tree(torch.tensor([[0, 2, 3]]), tree, None, target[:, [0, 0, 0, 0]], torch.zeros(1, 3), noise)
    assert none_of.num_accepted.tolist() == [0] and none_of.next_token.tolist() == [1]


def test_top_p_matches_hf_warper():
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 2
    for top_p in (0.3, 0.8, 0.95):
        hf = torch.softmax(TopPLogitsWarper(top_p)(None, logits.clone() / 0.7), -1)
        torch.testing.assert_close(probs_from_logits(logits, 0.7, top_p), hf)
    torch.testing.assert_close(probs_from_logits(logits, 1.0, 1.0), torch.softmax(logits, -1))


def test_exponential_race_samples_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = sample(probs.expand(40000, -1), torch.Generator().manual_seed(4))
    counts = torch.bincount(draws, minlength=5)
    assert counts[4] == 0
    assert chi2_pvalue(counts, probs) > 0.001


@pytest.mark.parametrize("chain", [True, False])
def test_one_step_output_token_is_the_verifiers(chain):
    """With synthetic q/p: the first token a step outputs (first draft if accepted, else the correction) ~ q."""
    rng = torch.Generator().manual_seed(5)
    B, V = 40000, 6
    q0 = torch.softmax(torch.randn(V, generator=rng) * 1.5, -1)
    p0 = torch.softmax(torch.randn(V, generator=rng) * 1.5, -1)  # a poor drafter
    if chain:
        tree = Tree.chain(1)
        tokens = torch.multinomial(p0, B, replacement=True, generator=rng)[:, None]
        probs = p0.expand(B, 1, V)
    else:  # three children drawn without replacement, each with its conditional distribution
        from draftheads.eval.drafters.sampling import pick_children
        from draftheads.eval.engine.protocol import Sampling

        tree = Tree.from_branching([3])
        tokens, probs = pick_children(p0.log().expand(B, 1, V), 3, Sampling(1.0, 1.0, rng))
        tokens, probs = tokens[:, 0], probs[:, 0]
    N = tokens.shape[1]
    target = torch.cat([q0.expand(B, 1, V), torch.softmax(torch.randn(B, N, V, generator=rng), -1)], 1)
    acc = sample_tree(tokens, tree, probs, target, torch.rand(B, N, generator=rng),
                      torch.empty(B, V).exponential_(generator=rng))
    nodes = torch.cat([torch.zeros(B, 1, dtype=torch.long), tokens], 1)
    first = torch.where(acc.num_accepted > 0, nodes.gather(1, acc.path[:, 1:2])[:, 0], acc.next_token)
    counts = torch.bincount(first, minlength=V).numpy()
    assert chi2_pvalue(counts, q0) > 0.001
    # Rejections really happen: the first candidate often, every candidate sometimes.
    assert ((acc.num_accepted == 0) | (acc.path[:, 1] != 1)).float().mean() > 0.1
    assert (acc.num_accepted == 0).float().mean() > 0.01


# ---- the seed's exercises ----------------------------------------------------------------------------------------
def simulate_chain(alpha_case: str, alpha: float, N: int, B: int, rng):
    V = 3
    if alpha_case == "one-hot":  # q(d) = alpha for the deterministic draft d = 0
        q = torch.tensor([alpha, 1 - alpha, 0.0])
        tokens = torch.zeros(B, N, dtype=torch.long)
        probs = None
    else:  # p and q share mass alpha on token 0 and put the rest on disjoint tokens: sum min(p, q) = alpha
        q = torch.tensor([alpha, 1 - alpha, 0.0])
        p = torch.tensor([alpha, 0.0, 1 - alpha])
        tokens = torch.multinomial(p, B * N, replacement=True, generator=rng).view(B, N)
        probs = p.expand(B, N, V)
    target = q.expand(B, N + 1, V)
    acc = sample_chain(tokens, probs, target, torch.rand(B, N, generator=rng),
                       torch.empty(B, V).exponential_(generator=rng))
    return acc.num_accepted


@pytest.mark.parametrize("case", ["one-hot", "sampled"])
@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_expected_tokens_per_verify(case, alpha):
    """E[tokens per verifier call] = (1 - alpha^(N+1)) / (1 - alpha) for acceptance rate alpha (Leviathan et al.)."""
    N, B = 4, 200000
    a = simulate_chain(case, alpha, N, B, torch.Generator().manual_seed(6))
    tau = (a + 1).float().mean().item()
    expected = (1 - alpha ** (N + 1)) / (1 - alpha)
    assert abs(tau - expected) < 0.02, (tau, expected)


def test_acceptance_falls_as_kl_grows():
    """Drafters further from the verifier (KL) get fewer tokens accepted; acceptance = 1 - TV(p, q)."""
    rng = torch.Generator().manual_seed(7)
    V, B = 32, 100000
    q = torch.softmax(torch.randn(V, generator=rng) * 2, -1)
    other = torch.softmax(torch.randn(V, generator=rng) * 2, -1)
    drafters = [(1 - lam) * q + lam * other for lam in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)]  # mixtures
    drafters += [torch.softmax(q.log() / t, -1) for t in (1.5, 3.0, 8.0)]  # flatter and flatter
    results = []
    for p in drafters:
        kl = (p * (p / q).log()).sum().item()
        tokens = torch.multinomial(p, B, replacement=True, generator=rng)[:, None]
        acc = sample_chain(tokens, p.expand(B, 1, V), q.expand(B, 2, V), torch.rand(B, 1, generator=rng),
                           torch.empty(B, V).exponential_(generator=rng))
        rate = acc.num_accepted.float().mean().item()
        assert abs(rate - torch.minimum(p, q).sum().item()) < 0.01
        results.append((kl, rate))
    mixtures, tempered = results[:6], [results[0]] + results[6:]
    for family in (mixtures, tempered):
        kls, rates = zip(*family)
        assert all(k1 < k2 for k1, k2 in zip(kls, kls[1:])), kls
        assert all(r1 > r2 for r1, r2 in zip(rates, rates[1:])), rates
    assert math.isclose(results[0][1], 1.0)
