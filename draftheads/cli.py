"""The `draftheads` command: one verb per thing a user does, each with its own `--help`.

    draftheads train eagle --config configs/eagle3-tiny.yaml [--section.key=value ...]
    draftheads eval --verifier tiny-code --method eagle --draft runs/eagle3-tiny/drafter --prompts humaneval --out DIR
    draftheads tune --verifier tiny-code --candidate eagle=runs/eagle3-tiny/drafter --prompts humaneval --out DIR
    draftheads recheck DIR/results.json

Flags are spelled the same way in every verb (`--kebab-case`); a trainer's config keys are dotted paths into its
YAML (`--train.lr=3e-4`), the same in `train` and `dump-features`. Each verb runs in this process; for several
processes launch a trainer with Accelerate (`accelerate launch train/eagle.py ...` from a checkout, or
`accelerate launch -m draftheads.train.eagle ...`). The `python -m draftheads.<module>` forms are aliases.
"""

from __future__ import annotations

import sys

#: verb -> (one line for the overview, the function that runs it with the verb's arguments)
VERBS: dict[str, tuple[str, str]] = {
    "train": ("train a drafter: `draftheads train medusa|eagle --config FILE [--key=value ...]`", "_train"),
    "eval": ("measure drafters beside plain decoding: tau, per-position acceptance, speedup", "_eval"),
    "tune": ("choose the method and draft length from measurements; print the engines' settings", "_tune"),
    "recheck": ("re-check a results.json: every greedy output equals plain greedy decoding", "_recheck"),
    "serve-check": ("load a drafter in real vLLM, decode with it and with our engine, and compare", "_serve_check"),
    "regenerate": ("self-distillation data: the verifier rewrites a source's answers", "_regenerate"),
    "dump-features": ("fill an offline hidden-state cache for a training run", "_dump_features"),
    "cache": ("check a hidden-state cache: `draftheads cache verify DIR`", "_cache"),
    "build-verifier": ("build the embedded default verifier (tiny-code, tiny-micro) into the cache", "_build_verifier"),
}
TRAINERS = ("medusa", "eagle")


def _train(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in TRAINERS:
        got = f"; got {argv[0]!r}" if argv and argv[0] not in ("-h", "--help") else ""
        print(f"usage: draftheads train {{{','.join(TRAINERS)}}} --config FILE.yaml [--section.key=value ...]\n"
              f"  the trainer to run comes first{got}; `draftheads train eagle --help` lists its config keys",
              file=sys.stderr if got else sys.stdout)
        return 2 if got or not argv else 0
    from draftheads.train.cli import main_guard

    if argv[0] == "medusa":
        from draftheads.train.medusa import MedusaRunConfig as cls, main
    else:
        from draftheads.train.eagle import EagleRunConfig as cls, main
    main_guard(main, cls, argv[1:], prog=f"draftheads train {argv[0]}")
    return 0


def _eval(argv):
    from draftheads.eval.__main__ import main

    return main(argv)


def _tune(argv):
    from draftheads.eval.measure.tune import main

    return main(argv)


def _recheck(argv):
    from draftheads.eval.measure.recheck import main

    return main(argv)


def _serve_check(argv):
    from draftheads.eval.interop.serve_check import main

    return main(argv)


def _regenerate(argv):
    from draftheads.train.regenerate import main

    return main(argv) or 0


def _dump_features(argv):
    from draftheads.train.dump_features import main

    return main(argv)


def _cache(argv):
    from draftheads.data.hidden_states import main

    return main(argv)


def _build_verifier(argv):
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see models/tiny/__main__.py
    from draftheads.models.tiny.cli import main

    return main(["build", *argv])


def usage() -> str:
    width = max(map(len, VERBS))
    lines = [f"  {verb.ljust(width)}  {line}" for verb, (line, _) in VERBS.items()]
    return ("usage: draftheads VERB [ARGS ...]   (draftheads VERB --help for a verb's flags)\n\nverbs:\n"
            + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.split("\n\n")[0] + "\n\n" + usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from draftheads import __version__

        print(f"draftheads {__version__}")
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"draftheads: unknown verb {verb!r}; expected one of {', '.join(VERBS)}", file=sys.stderr)
        return 2
    return globals()[VERBS[verb][1]](rest)


if __name__ == "__main__":
    sys.exit(main())
