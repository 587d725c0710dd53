"""The static-cache runtime computes what the Hugging Face model computes, for prefixes, trees and sliding windows."""

import pytest
import torch

from draftheads.eval.engine.runtime import ModelRunner, UnsupportedModelError, causal_mask
from draftheads.eval.engine.tree import Tree, tree_attention_mask
from tests.utils import FAMILIES, peaked_model, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # (T, V)


def path_to(tree: Tree, node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(node)
        node = int(tree.parents[0, node])
    return path[::-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_forward_equals_hf_forward_per_path(family):
    """Rows of different prefix lengths; every tree node's logits = the model on prefix + root + its path."""
    model = peaked_model(family)
    runner = ModelRunner(model)
    gen = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (9, 4)]
    tree = Tree.from_branching([2, 2, 1])
    N1 = tree.num_nodes
    nodes = torch.randint(3, 256, (2, N1), generator=gen)  # node 0 = the root token
    cache = runner.new_cache(2, 64)
    M = max(map(len, prefixes))
    padded = torch.tensor([p + [0] * (M - len(p)) for p in prefixes])
    pos = torch.arange(M).expand(2, M)
    with torch.no_grad():
        runner(cache, padded, pos, pos, causal_mask(M, 32, "cpu").expand(2, -1, -1), logits=False)
        L = torch.tensor([len(p) for p in prefixes])
        t = tree.expand(2)
        out = runner(cache, nodes, L[:, None] + t.depth, L[:, None] + torch.arange(N1),
                     tree_attention_mask(L, t.ancestors, 32), layer_ids=(1,))
    for b, prefix in enumerate(prefixes):
        for node in range(N1):
            ids = prefix + [int(nodes[b, 0])] + [int(nodes[b, j]) for j in path_to(tree, node)]
            torch.testing.assert_close(out.logits[b, node], hf_logits(model, ids)[-1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_layers(family):
    """Mistral (every layer) and Qwen2 (layers past max_window_layers) sliding windows are honoured."""
    if family == "mistral":  # tests.utils builds Mistral with sliding_window=None; set it after construction
        model = peaked_model(family)
        model.config.sliding_window = 3
    else:
        model = peaked_model(family, use_sliding_window=True, sliding_window=3, max_window_layers=2)
    full = peaked_model(family)
    assert any(w is not None for w in ModelRunner(model).layer_windows)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(model, ids[0].tolist())
    assert not torch.allclose(ref, hf_logits(full, ids[0].tolist()), atol=1e-3)  # the window matters here
    runner = ModelRunner(model)
    cache = runner.new_cache(1, 32)
    pos = torch.arange(8)[None]
    with torch.no_grad():
        first = runner(cache, ids[:, :8], pos, pos, causal_mask(8, 32, "cpu"))
        chain = Tree.chain(3)
        L = torch.tensor([8])
        rest = runner(cache, ids[:, 8:], L[:, None] + chain.depth, L[:, None] + torch.arange(4),
                      tree_attention_mask(L, chain.ancestors, 32))
    torch.testing.assert_close(torch.cat([first.logits[0], rest.logits[0]]), ref, atol=2e-5, rtol=1e-4)


def test_compaction_moves_the_accepted_path():
    model = peaked_model("llama")
    runner = ModelRunner(model)
    prefix = [5, 17, 3, 99]
    tree = Tree.from_branching([2, 2])  # nodes 1,2 at depth 1; 3,4 under 1; 5,6 under 2
    nodes = torch.tensor([[42, 10, 11, 12, 13, 14, 15]])
    cache = runner.new_cache(1, 32)
    pos = torch.arange(4)[None]
    with torch.no_grad():
        runner(cache, torch.tensor([prefix]), pos, pos, causal_mask(4, 32, "cpu"), logits=False)
        L = torch.tensor([4])
        runner(cache, nodes, L[:, None] + tree.depth, L[:, None] + torch.arange(7),
               tree_attention_mask(L, tree.ancestors, 32), logits=False)
        cache.compact(L, torch.tensor([[0, 2, 6]]))  # keep root -> node 2 -> node 6
        fresh = model(torch.tensor([prefix + [42, 11, 15]]), use_cache=True).cache
    for i, layer in enumerate(fresh.layers):
        torch.testing.assert_close(cache.keys[i][:, :, :7], layer.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cache.values[i][:, :, :7], layer.values, atol=1e-5, rtol=1e-4)
    assert cache.key_positions[0, :7].tolist() == list(range(7))


def test_unsupported_family_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        ModelRunner(model)


def test_flash_attention_is_refused():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedModelError, match="attn_implementation"):
        ModelRunner(model)
