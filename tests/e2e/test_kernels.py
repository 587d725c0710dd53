"""The fused Triton kernels (eval/engine/kernels.py) equal their torch references, output for output.

On a CPU the kernels run through Triton's interpreter, which Triton switches on once per process, when it is first
imported (TRITON_INTERPRET=1). So `test_kernels_under_interpreter` runs this file again in a child pytest with the
variable set; in this process the CPU cases skip, and nothing here changes how the rest of the suite imports
triton. On a GPU the same cases run compiled (`-m cuda`), plus larger shapes (vocabulary 32000, 64-node trees,
16-layer caches). `test_kernels_compile_for_hopper` compiles every kernel for sm_90 without a GPU.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftheads.eval.engine import kernels
from draftheads.eval.engine.acceptance import accept, greedy_tree, probs_from_logits, sample_tree
from draftheads.eval.engine.runtime import StaticKVCache
from draftheads.eval.engine.tree import Tree

pytestmark = pytest.mark.skipif(not kernels.triton_available(),
                                reason="triton is not installed (pip install 'draftheads[cuda]')")

INTERPRETED = kernels.interpreter_active()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=(["cpu"] if INTERPRETED else []) + [pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """CPU cases exist only in the interpreted child run; CUDA cases only in a compiled run."""
    if request.param == "cuda" and INTERPRETED:
        pytest.skip("compiled kernels are checked without TRITON_INTERPRET")
    return torch.device(request.param)


def test_kernels_under_interpreter():
    """Every CPU case of this file, in a child pytest whose triton is imported with TRITON_INTERPRET=1."""
    if INTERPRETED:
        pytest.skip("this is the child run")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
                          "-W", "ignore::UserWarning", __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"interpreted kernel cases failed:\n{out[-6000:]}"
    assert " passed" in out and " failed" not in out, out[-2000:]
    print(f"interpreted kernel cases: {time.perf_counter() - t:.1f}s; {out.strip().splitlines()[-1]}")


# ---- cases ---------------------------------------------------------------------------------------------------------
def random_parents(B, N, gen, chain=False):
    """(B, N+1) parents, a different random tree per row (or the chain)."""
    if chain:
        return torch.arange(-1, N).expand(B, -1).clone()
    parents = torch.full((B, N + 1), -1, dtype=torch.long)
    for i in range(1, N + 1):
        parents[:, i] = (torch.rand(B, generator=gen) * i).long()  # uniform over 0..i-1
    return parents


def make_tree(parents, chain=False):
    B, N1 = parents.shape
    return Tree.chain(N1 - 1, B) if chain else Tree.from_parents(parents)


def greedy_case(B, N, V, gen, chain=False, match=0.8, dtype=torch.float32, scale=1.0):
    """Logits and draft tokens that follow the verifier's argmax at their parent with probability `match`."""
    parents = random_parents(B, N, gen, chain)
    tree = make_tree(parents, chain)
    logits = (scale * torch.randn(B, N + 1, V, generator=gen)).to(dtype)
    top = logits.float().argmax(-1)
    good = top.gather(1, parents[:, 1:].clamp_min(0))
    other = torch.randint(0, V, (B, N), generator=gen)
    tokens = torch.where(torch.rand(B, N, generator=gen) < match, good, other)
    return tree, tokens, logits


def sample_case(B, N, V, gen, chain=False, with_probs=True, temperature=1.0, top_p=1.0, closeness=0.7):
    """Verifier probs (temperature, top-p) and draft tokens drawn from draft probs that resemble them."""
    parents = random_parents(B, N, gen, chain)
    tree = make_tree(parents, chain)
    logits = 2.0 * torch.randn(B, N + 1, V, generator=gen)
    target = probs_from_logits(logits, temperature, top_p)  # (B, N+1, V)
    at_parent = logits.gather(1, parents[:, 1:].clamp_min(0)[..., None].expand(B, N, V))
    draft_logits = at_parent + closeness * 2.0 * torch.randn(B, N, V, generator=gen)
    draft = probs_from_logits(draft_logits, temperature, top_p)
    if with_probs:
        tokens = torch.multinomial(draft.reshape(B * N, V), 1, generator=gen).reshape(B, N)
    else:
        tokens, draft = draft_logits.argmax(-1), None  # deterministic picks: one-hot draft distributions
    uniform = torch.rand(B, N, generator=gen)
    noise = torch.empty(B, V).exponential_(generator=gen).clamp_min_(1e-20)
    return tree, tokens, draft, target, uniform, noise


def to(device, *xs):
    return [None if x is None else x.to(device) for x in xs]


def assert_same(got, ref, what=""):
    assert torch.equal(got.num_accepted.cpu(), ref.num_accepted.cpu()), (what, got.num_accepted, ref.num_accepted)
    assert torch.equal(got.path.cpu(), ref.path.cpu()), (what, got.path, ref.path)
    assert torch.equal(got.next_token.cpu(), ref.next_token.cpu()), (what, got.next_token, ref.next_token)
    assert got.num_accepted.dtype == got.path.dtype == got.next_token.dtype == torch.long


def run_greedy(device, tree, tokens, logits):
    tree, tokens, logits = to(device, tree, tokens, logits)
    got = kernels.greedy_accept(tokens, tree, logits, backend="triton")
    return got, greedy_tree(tokens.cpu(), tree.to("cpu"), logits.cpu())


def run_sample(device, tree, tokens, draft, target, uniform, noise):
    tree, tokens, draft, target, uniform, noise = to(device, tree, tokens, draft, target, uniform, noise)
    got = kernels.sample_accept(tokens, tree, draft, target, uniform, noise, backend="triton")
    cpu = [x.cpu() if x is not None else None for x in (draft, target, uniform, noise)]
    return got, sample_tree(tokens.cpu(), tree.to("cpu"), cpu[0], *cpu[1:])


# ---- greedy --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chain", [False, True])
def test_greedy_kernel_random_trees(device, chain):
    gen = torch.Generator().manual_seed(1)
    for B, N, V in [(3, 9, 37), (2, 14, 101), (4, 5, 300)]:
        got, ref = run_greedy(device, *greedy_case(B, N, V, gen, chain))
        assert_same(got, ref, (B, N, V))
        assert ref.num_accepted.max() > 0  # the cases do accept something


def test_greedy_kernel_edges(device):
    gen = torch.Generator().manual_seed(2)
    V = 53
    for chain in (True, False):
        got, ref = run_greedy(device, *greedy_case(3, 6, V, gen, chain, match=0.0))  # nothing accepted
        assert_same(got, ref)
        assert int(ref.num_accepted.max()) <= 1  # (a random token can still equal the argmax by chance)
        tree, tokens, logits = greedy_case(3, 6, V, gen, chain, match=1.0)  # every node matches
        got, ref = run_greedy(device, tree, tokens, logits)
        assert_same(got, ref)
        assert torch.equal(ref.num_accepted, tree.expand(3).depth.max(-1).values)  # the deepest node wins
    for N in (1, 0):  # a chain of one draft token; autoregressive (the root alone)
        got, ref = run_greedy(device, *greedy_case(3, N, V, gen, chain=True))
        assert_same(got, ref, N)


def test_greedy_kernel_ties_bf16_and_shared_tree(device):
    """Many exact ties (bf16 logits from a few values): the lowest index wins, as in torch.argmax; a static
    tree shared by all rows (batch stride 0); vocabularies around the kernel's block size."""
    gen = torch.Generator().manual_seed(3)
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])  # one row, expanded inside
    N = tree.num_nodes - 1
    for V in (29, 1000):
        logits = torch.randint(0, 3, (4, N + 1, V), generator=gen).to(torch.bfloat16)
        top = logits.float().argmax(-1)
        tokens = top.gather(1, tree.parents.expand(4, -1)[:, 1:].clamp_min(0))
        tokens[1, 0] += 1  # row 1 rejects its first candidate
        got, ref = run_greedy(device, tree, tokens, logits)
        assert_same(got, ref, V)
    logits = torch.zeros(2, 4, 19)
    logits[0] = float("-inf")  # everything -inf: torch says index 0
    got, ref = run_greedy(device, Tree.chain(3, 2), torch.zeros(2, 3, dtype=torch.long), logits)
    assert_same(got, ref)


# ---- sampling ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("with_probs", [True, False])
def test_sample_kernel_random_trees(device, chain, with_probs):
    gen = torch.Generator().manual_seed(4)
    accepted = 0
    for B, N, V, T, top_p in [(3, 8, 37, 1.0, 1.0), (2, 12, 101, 0.7, 0.9), (3, 6, 250, 1.6, 0.8)]:
        case = sample_case(B, N, V, gen, chain, with_probs, T, top_p)
        got, ref = run_sample(device, *case)
        assert_same(got, ref, (B, N, V, T, top_p))
        accepted += int(ref.num_accepted.sum())
    assert accepted > 0


def test_sample_kernel_edges(device):
    gen = torch.Generator().manual_seed(5)
    V = 41
    for chain in (True, False):
        for with_probs in (True, False):
            tree, tokens, draft, target, uniform, noise = sample_case(3, 5, V, gen, chain, with_probs, 0.8, 0.5)
            # Nothing accepted: every draft token outside the verifier's nucleus (q = 0 there).
            outside = (target == 0).float().argmax(-1)  # (B, N+1) a zero-probability token after each node
            parents = tree.expand(3).parents
            bad = outside.gather(1, parents[:, 1:])
            got, ref = run_sample(device, tree, bad, draft, target, uniform, noise)
            assert_same(got, ref, "nothing")
            assert int(ref.num_accepted.max()) == 0
            # Everything on the first path accepted: uniform 0 accepts any token with q > 0.
            inside = target.argmax(-1).gather(1, parents[:, 1:])
            got, ref = run_sample(device, tree, inside, draft, target, torch.zeros_like(uniform), noise)
            assert_same(got, ref, "everything")
            assert bool((ref.num_accepted == tree.max_depth).all()) if chain else bool((ref.num_accepted > 0).all())
    for N in (1, 0):  # chain of length 1 (bonus or correction), and the root alone (plain sampling)
        got, ref = run_sample(device, *sample_case(3, N, V, gen, chain=True, temperature=1.3, top_p=0.95))
        assert_same(got, ref, N)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_accept_kernel_draws_like_accept(device, temperature):
    """kernels.accept draws the same randomness in the same order as draftheads.eval.engine.acceptance.accept: same seed, same
    tokens (the fused loop and the unfused one agree on a seed)."""
    gen = torch.Generator().manual_seed(6)
    for chain in (True, False):
        tree, tokens, draft, *_ = sample_case(3, 7, 67, gen, chain, True, 1.0, 1.0)
        logits = 3.0 * torch.randn(3, 8, 67, generator=gen)
        g1 = torch.Generator(device).manual_seed(11)
        got = kernels.accept(*to(device, tokens, tree, draft, logits), temperature=temperature, top_p=0.9,
                             generator=g1, backend="triton")
        g2 = torch.Generator(device).manual_seed(11)
        ref = accept(*to(device, tokens, tree, draft, logits), temperature=temperature, top_p=0.9, generator=g2)
        assert_same(got, ref, chain)


# ---- KV compaction -------------------------------------------------------------------------------------------------
def cache_case(device, dtype, L=3, B=3, H=2, C=24, hd=12, N=7, seed=7):
    gen = torch.Generator().manual_seed(seed)
    cache = StaticKVCache(L, B, C, H, hd, dtype, device)
    for t in (*cache.keys, *cache.values):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    cache.key_positions.copy_(torch.randint(0, 100, cache.key_positions.shape, generator=gen))
    tree, tokens, logits = greedy_case(B, N, 11, gen, chain=False, match=0.9)
    path = greedy_tree(tokens, tree, logits).path  # (B, D+1), padded with the last accepted node
    base = torch.randint(0, C - N - 1, (B,), generator=gen)
    return cache, base.to(device), path.to(device)


def clone_cache(cache):
    twin = StaticKVCache(len(cache.keys), cache.batch_size, cache.capacity, cache.keys[0].shape[1],
                         cache.keys[0].shape[3], cache.keys[0].dtype, cache.keys[0].device)
    for a, b in zip((*twin.keys, *twin.values, twin.key_positions), (*cache.keys, *cache.values,
                                                                      cache.key_positions)):
        a.copy_(b)
    return twin


def assert_same_cache(a, b):
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):  # bit-exact, garbage slots included
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.uint8) if y.dtype == torch.bfloat16 else y)
    assert torch.equal(a.key_positions, b.key_positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_kernel_equals_reference(device, dtype):
    cache, base, path = cache_case(device, dtype)
    assert bool((path != torch.arange(path.shape[1], device=device)).any())  # something really moves
    ref = clone_cache(cache)
    ref.compact(base, path)
    kernels.compact(cache, base, path, backend="triton")
    assert_same_cache(cache, ref)
    # A chain's path (identity then padding) and a batch whose rows accept nothing.
    chain_path = torch.minimum(torch.arange(5, device=device)[None], torch.tensor([[0], [2], [4]], device=device))
    ref.compact(base, chain_path)
    kernels.compact(cache, base, chain_path, backend="triton")
    assert_same_cache(cache, ref)


def test_fused_kv_cache_compacts_through_the_kernel(device):
    cache, base, path = cache_case(device, torch.float32, seed=8)
    fused = kernels.FusedKVCache(len(cache.keys), cache.batch_size, cache.capacity, cache.keys[0].shape[1],
                                 cache.keys[0].shape[3], torch.float32, device, backend="triton")
    for a, b in zip((*fused.keys, *fused.values, fused.key_positions), (*cache.keys, *cache.values,
                                                                       cache.key_positions)):
        a.copy_(b)
    cache.compact(base, path)
    fused.compact(base, path)
    assert_same_cache(fused, cache)


# ---- without a GPU: errors and the compiler ------------------------------------------------------------------------
def test_kernel_backend_errors():
    tree, tokens, logits = greedy_case(2, 3, 17, torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match="backend"):
        kernels.greedy_accept(tokens, tree, logits, backend="cuda")
    if INTERPRETED:
        with pytest.raises(ValueError, match="do not agree"):
            kernels.greedy_accept(tokens[:, :2], tree, logits, backend="triton")
    else:
        with pytest.raises(kernels.KernelUnavailable, match="TRITON_INTERPRET"):
            kernels.greedy_accept(tokens, tree, logits, backend="triton")
    # "auto" on CPU tensors without the interpreter, and "torch" anywhere: the reference itself.
    assert_same(kernels.greedy_accept(tokens, tree, logits, backend="torch"), greedy_tree(tokens, tree, logits))


def _signatures():
    """(kernel name, argument types, constexprs) for every kernel variant the decode loop launches."""
    i64, i32 = "*i64", "i32"
    walk = {"argmax_ptr": i64, "tokens_ptr": i64, "parents_ptr": i64, "depth_ptr": i64, "anc_ptr": "*u8",
            "num_acc_ptr": i64, "path_ptr": i64, "next_ptr": i64, "N": i32, "D": i32, "s_par_b": i32,
            "s_dep_b": i32, "s_anc_b": i32, "s_anc_i": i32}
    sample = {"tokens_ptr": i64, "children_ptr": i64, "dprobs_ptr": "*fp32", "tprobs_ptr": "*fp32",
              "uniform_ptr": "*fp32", "noise_ptr": "*fp32", "scratch_ptr": "*fp32", "num_acc_ptr": i64,
              "path_ptr": i64, "next_ptr": i64, "N": i32, "D": i32, "K": i32, "V": i32, "s_ch_b": i32,
              "s_ch_i": i32, "s_ch_k": i32}
    compact = {"table_ptr": i64, "positions_ptr": i64, "base_ptr": i64, "path_ptr": i64, "P": i32, "s_b": i32,
               "s_h": i32, "s_slot": i32, "s_pos_b": i32, "HD": i32}
    yield "argmax_rows_kernel", {"x_ptr": "*bf16", "out_ptr": i64, "V": i32, "stride_row": i32}, {"BLOCK_V": 1024}
    yield "greedy_walk_kernel", walk, {"NP": 64, "DP": 8}
    for has_probs in (True, False):
        for chain in (True, False):
            yield "sample_walk_kernel", sample, {"HAS_PROBS": has_probs, "IS_CHAIN": chain, "BLOCK_V": 1024}
    for elem in (2, 4):
        yield "compact_kernel", compact, {"ELEM": elem, "BLOCK_D": 128}


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_kernels_compile_for_hopper():
    """Every kernel goes through Triton's compiler to sm_90 machine code (no GPU needed): what the interpreter
    accepts, the compiler accepts too; divisions are the IEEE ones."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import draftheads.eval.engine._triton_kernels as k

    target = GPUTarget("cuda", 90, 32)
    for name, signature, constexprs in _signatures():
        try:
            src = ASTSource(getattr(k, name), signature={**signature, **{c: "constexpr" for c in constexprs}},
                            constexprs=constexprs)
        except TypeError as e:  # Triton's ahead-of-time API moves between releases
            pytest.skip(f"this triton's ASTSource takes other arguments: {e}")
        try:
            compiled = triton.compile(src, target=target, options=dict(enable_fp_fusion=False))
        except Exception as e:  # no CUDA backend or ptxas in this triton build
            if "ptxas" in str(e) or "backend" in str(e).lower():
                pytest.skip(f"triton cannot compile for CUDA here: {e}")
            raise
        assert compiled.asm["cubin"], name
        ptx = compiled.asm["ptx"]
        assert "div.approx.f32" not in ptx and "div.full.f32" not in ptx, name


# ---- on a GPU: the decode loop's real shapes -----------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("chain", [False, True])
def test_greedy_kernel_cuda_large(chain):
    gen = torch.Generator().manual_seed(10)
    for dtype in (torch.bfloat16, torch.float32):
        got, ref = run_greedy(torch.device("cuda"), *greedy_case(8, 63 if not chain else 8, 32000, gen, chain,
                                                                  match=0.9, dtype=dtype))
        assert_same(got, ref, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("chain", [False, True])
def test_sample_kernel_cuda_large(chain, with_probs):
    gen = torch.Generator().manual_seed(11)
    got, ref = run_sample(torch.device("cuda"), *sample_case(8, 7 if chain else 40, 32000, gen, chain, with_probs,
                                                             0.9, 0.95))
    assert_same(got, ref)


@pytest.mark.cuda
def test_compact_kernel_cuda_large():
    cache, base, path = cache_case(torch.device("cuda"), torch.bfloat16, L=16, B=4, H=8, C=512, hd=128, N=40)
    ref = clone_cache(cache)
    ref.compact(base, path)
    kernels.compact(cache, base, path, backend="triton")
    torch.cuda.synchronize()
    assert_same_cache(cache, ref)


# ---- the fused decode loop on the kernels ----------------------------------------------------------------------------
@pytest.mark.parametrize("branching", [[2, 2, 1], [1, 1, 1]])
def test_fused_loop_kernel_equals_unfused(device, branching):
    """FusedDecoder on the kernels (interpreted here; compiled, with CUDA graphs, on a GPU) gives the unfused
    decoder's greedy tokens, for a tree and a chain, batch 2 padded to a bucket of 4; with graphs off, sampling
    gives the same tokens for the same seed as well."""
    from draftheads.eval import SpeculativeDecoder
    from draftheads.eval.drafters import make_drafter
    from draftheads.eval.engine.cuda_loop import Buckets, FusedDecoder
    from draftheads.models.verifier import Verifier
    from tests.utils import noisy_copy, peaked_model

    torch.manual_seed(0)
    model = peaked_model("llama", vocab_size=97)
    draft = noisy_copy(model, 0.2)  # on the CPU (its noise comes from a CPU generator); make_drafter moves it
    verifier = Verifier(model.to(device))
    drafter = make_drafter("draft-model", verifier, draft, branching=branching)
    dec = SpeculativeDecoder(verifier, drafter, "draft-model")
    fused = FusedDecoder(dec, backend="triton", buckets=Buckets(batch=(4,), capacity=64, window=64))
    prompts = [[5, 77, 31, 20, 9, 77, 31], [42, 8]]
    for _ in range(2 if device.type == "cuda" else 1):  # the second call replays what the first one captured
        want = dec.generate(prompts, 12)
        got = fused.generate(prompts, 12)
        assert got.output_ids == want.output_ids
        assert got.stats.accepted == want.stats.accepted
    if device.type == "cuda":
        assert fused.graphs.captures > 0 and not fused.graphs.failures
    else:
        exact = FusedDecoder(dec, backend="triton", buckets=Buckets(batch=None, capacity=64, window=64))
        want = dec.generate(prompts, 12, temperature=0.9, top_p=0.95, seed=5)
        got = exact.generate(prompts, 12, temperature=0.9, top_p=0.95, seed=5)
        assert got.output_ids == want.output_ids
