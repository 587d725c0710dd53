"""Long prompts for the decode benchmark: the opening of held-out stdlib files, each cut at a line end once it is
at least `--tokens` tokens long (EAGLE 3.1's norms are meant for long contexts; HumanEval prompts are short).

    PYTHONPATH=. python scripts/long_prompts.py --verifier tiny-micro --tokens 1024 --num 8 --out runs/long.jsonl
    PYTHONPATH=. python scripts/bench_decode.py --prompts runs/long.jsonl ...

Files of the stdlib `eval` split (the drafters never train on them), in their sorted order, skipping those shorter
than the cut; rows are {"id": relative path, "text": the opening}, a raw completion prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def long_openings(tokenizer, files: list[Path], root: Path, min_tokens: int, num: int) -> list[dict]:
    """Up to `num` rows: each file's first lines, as few as reach `min_tokens` tokens."""
    from draftheads.data.stdlib import read_source

    rows = []
    for path in files:
        lines = read_source(path).splitlines(keepends=True)
        text, count = "", 0
        for line in lines:
            text += line
            if len(text) > 2 * min_tokens:  # a token is several characters: count only near the cut
                count = len(tokenizer(text)["input_ids"])
                if count >= min_tokens:
                    break
        if count >= min_tokens:
            rows.append({"id": path.relative_to(root).as_posix(), "text": text})
        if len(rows) == num:
            break
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="tiny-code")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--num", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from draftheads.data.stdlib import stdlib_files, stdlib_root
    from draftheads.models.atomic import write_text
    from draftheads.models.verifier import Verifier

    tokenizer = AutoTokenizer.from_pretrained(Verifier.from_pretrained(args.verifier).path)
    rows = long_openings(tokenizer, stdlib_files("eval"), stdlib_root(), args.tokens, args.num)
    if not rows:
        raise SystemExit(f"no held-out stdlib file reaches {args.tokens} tokens")
    write_text(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    print(f"[long-prompts] {len(rows)} prompts of >= {args.tokens} tokens -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
