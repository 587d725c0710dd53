"""Self-distillation data shaped like HumanEval: stdlib functions cut after their docstring, continued by the verifier.

    PYTHONPATH=. python scripts/selfdistill_data.py --verifier tiny-code --out runs/bench/selfdistill.jsonl \
        [--num-prompts 800] [--max-new-tokens 192] [--batch-size 16]

A drafter learns to predict the verifier, so it learns best from the verifier's own continuations (the
self-distillation of Medusa-2 and EAGLE; `draftheads.train.regenerate`). Which continuations matters too: HumanEval prompts
are a function signature and docstring, after which the verifier writes a body, while the head of a stdlib file
(what `draftheads.train.regenerate --source stdlib` continues) is a licence and a module docstring. So the prompts here are
every function / method of the stdlib `drafter` and `verifier` splits that has a docstring, from its `def` (or
first decorator) to the end of the docstring, dedented, spread evenly over the files; `draftheads.train.regenerate` then
continues each greedily. The output JSONL (`text` rows) is a training source: `--data.source=<out>`.
Never HumanEval itself: the evaluation prompts stay unseen.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def function_prompts(source: str) -> list[str]:
    """Each function with a docstring in `source`: its decorators, signature and docstring, dedented."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = node.body[0].end_lineno
        text = textwrap.dedent("".join(lines[start - 1: end]))
        if text.strip():
            prompts.append(text if text.endswith("\n") else text + "\n")
    return prompts


def collect(num_prompts: int, splits=("drafter", "verifier")) -> list[str]:
    """Up to `num_prompts` function prompts, taken round-robin over the files so that every module contributes."""
    from draftheads.data.stdlib import read_source, stdlib_files

    per_file = [p for split in splits for f in stdlib_files(split) if (p := function_prompts(read_source(f)))]
    out, i = [], 0
    while len(out) < num_prompts and any(i < len(p) for p in per_file):
        out += [p[i] for p in per_file if i < len(p)]
        i += 1
    return out[:num_prompts]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="tiny-code")
    p.add_argument("--out", required=True)
    p.add_argument("--num-prompts", type=int, default=800)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--prefix-tokens", type=int, default=384, help="longer prompts keep their first this many tokens")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    prompts = collect(args.num_prompts)
    print(f"[selfdistill] {len(prompts)} function prompts from the stdlib drafter and verifier splits", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "function_prompts.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in prompts))
        cmd = [sys.executable, "-m", "draftheads.train.regenerate", "--verifier", args.verifier, "--source", str(source),
               "--out", args.out, "--format", "text", "--max-new-tokens", str(args.max_new_tokens),
               "--prefix-tokens", str(args.prefix_tokens), "--batch-size", str(args.batch_size),
               "--temperature", str(args.temperature), "--dtype", "float32"]
        return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
