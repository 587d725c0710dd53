"""The brief's exercise: expected tokens per verifier call against draft length N, formula and simulation, and the
optimal N when each draft token costs a fraction of a verifier call.

    PYTHONPATH=. python scripts/plot_draft_length.py --out docs/benchmarks/draft_length.png

Prints the table (formula, simulation, and the optimal N and its speedup for draft costs 0.02, 0.05, 0.1 and 0.3
verifier calls per token) and draws both curves per acceptance rate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from draftheads.eval.measure.tune import expected_tokens, optimal_draft_length, simulated_tokens, speedup_iid

ALPHAS = (0.5, 0.7, 0.85)
COSTS = (0.02, 0.05, 0.1, 0.3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/benchmarks/draft_length.png")
    p.add_argument("--max-n", type=int, default=12)
    p.add_argument("--steps", type=int, default=100_000, help="simulated verifier calls per point")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = list(range(args.max_n + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    print("| alpha | N | formula | simulation |")
    print("|---:|---:|---:|---:|")
    for alpha in ALPHAS:
        exact = [expected_tokens(alpha, n) for n in ns]
        sim = [simulated_tokens(alpha, n, args.steps, seed=n) for n in ns]
        for n in (1, 3, 6, 12):
            if n <= args.max_n:
                print(f"| {alpha} | {n} | {exact[n]:.3f} | {sim[n]:.3f} |")
        line, = left.plot(ns, exact, label=f"alpha={alpha} (formula)")
        left.scatter(ns, sim, marker="x", color=line.get_color(), label=f"alpha={alpha} (simulated)")
        right.plot(ns, [speedup_iid(alpha, n, 0.1) for n in ns], color=line.get_color(), label=f"alpha={alpha}")
        best = optimal_draft_length(alpha, 0.1, args.max_n)
        right.scatter([best], [speedup_iid(alpha, best, 0.1)], color=line.get_color(), s=60)
    print("\n| alpha | draft cost / verifier call | optimal N | speedup |")
    print("|---:|---:|---:|---:|")
    for alpha in ALPHAS:
        for cost in COSTS:
            n = optimal_draft_length(alpha, cost)
            print(f"| {alpha} | {cost} | {n} | {speedup_iid(alpha, n, cost):.2f}x |")
    left.set(xlabel="draft length N", ylabel="tokens per verifier call", title="(1 - a^(N+1)) / (1 - a)")
    right.set(xlabel="draft length N", ylabel="speedup", title="draft cost 0.1 verifier call per token")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
