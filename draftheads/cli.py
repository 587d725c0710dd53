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

#: verb -> (one line for the overview, the module whose `main(argv)` runs it; None: a function of this file)
VERBS: dict[str, tuple[str, str | None]] = {
    "train": ("train a drafter: `draftheads train medusa|eagle|dflash --config FILE [--key=value ...]`", None),
    "eval": ("measure drafters beside plain decoding: tau, per-position acceptance, speedup",
             "draftheads.eval.__main__"),
    "tune": ("choose the method and draft length from measurements; print the engines' settings",
             "draftheads.eval.measure.tune"),
    "recheck": ("re-check a results.json: every greedy output equals plain greedy decoding",
                "draftheads.eval.measure.recheck"),
    "serve-check": ("load a drafter in real vLLM, decode with it and with our engine, and compare",
                    "draftheads.eval.interop.serve_check"),
    "import-peer": ("say what vLLM would read wrongly in another trainer's EAGLE-3 folder; --fix OUT writes it right",
                    "draftheads.eval.interop.peer_folder"),
    "regenerate": ("self-distillation data: the verifier rewrites a source's answers", "draftheads.train.regenerate"),
    "dump-features": ("fill an offline hidden-state cache for a training run", "draftheads.train.dump_features"),
    "cache": ("check a hidden-state cache: `draftheads cache verify DIR`", "draftheads.data.hidden_states"),
    "build-verifier": ("build an embedded verifier (tiny-code, tiny-micro; code-100m on a GPU)", None),
}
TRAINERS = ("medusa", "eagle", "dflash", "mtp")


def _train(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in TRAINERS:
        got = f"; got {argv[0]!r}" if argv and argv[0] not in ("-h", "--help") else ""
        print(f"usage: draftheads train {{{','.join(TRAINERS)}}} --config FILE.yaml [--section.key=value ...]\n"
              f"  the trainer to run comes first{got}; `draftheads train eagle --help` lists its config keys",
              file=sys.stderr if got else sys.stdout)
        return 2 if got or not argv else 0
    from draftheads.train.cli import main_guard

    cls, main = trainer(argv[0])
    main_guard(main, cls, argv[1:], prog=f"draftheads train {argv[0]}")
    return 0


def trainer(name: str):
    """(its RunConfig class, its main) for one of TRAINERS; imports the trainer's module (torch, transformers)."""
    if name == "medusa":
        from draftheads.train.medusa import MedusaRunConfig as cls, main
    elif name == "dflash":
        from draftheads.train.dflash import DFlashRunConfig as cls, main
    elif name == "mtp":
        from draftheads.train.mtp import MtpRunConfig as cls, main
    else:
        from draftheads.train.eagle import EagleRunConfig as cls, main
    return cls, main


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
    if verb == "train":
        return _train(rest)
    if verb == "build-verifier":
        return _build_verifier(rest)
    import importlib  # each verb imports only its own module: `draftheads --help` stays instant

    return importlib.import_module(VERBS[verb][1]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
