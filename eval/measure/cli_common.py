"""What the eval commands share (`draftheads eval`, `draftheads tune`): the usage error and one line per error, the
`--out` lock, the verifier's tokenizer, prompts encoded and checked against the verifier's context."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


class UsageError(ValueError):
    """A command line that cannot run; the message says which flag to fix."""


def report_errors(command, *args) -> int:
    """Run `command(*args)`; a user's mistake or an environment fault becomes one line on stderr and an exit status
    (2: the command line; 1: a file, model, drafter or disk; 130: Ctrl-C), never a traceback (DRAFTHEADS_TRACEBACK=1
    shows the one of a ValueError from an engine check)."""
    from draftheads.data.config import DataError
    from draftheads.models.eagle import EagleError
    from draftheads.models.export import DrafterFormatError
    from draftheads.models.verifier import VerifierError

    try:
        return command(*args)
    except KeyboardInterrupt:  # Ctrl-C: results are written only at the end, so nothing half-written is left
        print("stopped by SIGINT (Ctrl-C) before the results were written; nothing of this run was written",
              file=sys.stderr)
        return 130
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (DataError, VerifierError, DrafterFormatError, EagleError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # a method option out of range (the engine's checks name the option)
        if os.environ.get("DRAFTHEADS_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {err.strerror or err}{f' ({err.filename})' if err.filename else ''}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def hold_out_folder(out: str, kind: str = "eval"):
    """One eval (or tune) per `--out` at a time: its lock (models/atomic.py, as a run folder's) held while the command
    runs, and a second one into it refused in one line. `--out` must be new, empty or an earlier output of the same
    command (`kind`: models/outputs.py), never a run folder or a cache that its files would land in. An --out the
    command created and left empty (an error, a Ctrl-C before the results were written) is removed again."""
    from draftheads.models.atomic import LOCK_FILE, FolderInUse, lock_folder, unlock_folder
    from draftheads.models.outputs import OutputInTheWay, claim_output

    folder = Path(out)

    def claim():
        try:
            claim_output(folder, kind, "--out")
        except OutputInTheWay as err:
            raise UsageError(str(err)) from None

    # Judged once: before the lock, so that nothing (not even a lock file) is added to a folder that is refused;
    # after it when the folder has a lock file (an eval holds it, or held it), so one in use is named as such.
    had_lock = (folder / LOCK_FILE).is_file()
    if not had_lock:
        claim()
    created, held = not folder.exists(), False
    try:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock_folder(folder)
            held = True
        except FolderInUse as err:
            raise UsageError(f"--out {out} is in use by another draftheads eval or tune ({err.holder}); wait for it "
                             "to end or use another --out (nothing it wrote was touched)") from None
        except OSError:  # a folder that cannot be made: check_args names it
            pass
        if had_lock:
            claim()
        yield
    finally:
        if held:
            unlock_folder(folder)
        if created and folder.is_dir() and {p.name for p in folder.iterdir()} <= {LOCK_FILE}:
            (folder / LOCK_FILE).unlink(missing_ok=True)
            folder.rmdir()


def load_tokenizer(verifier, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    folder = verifier.path
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as err:  # no tokenizer files: say which folder
        raise UsageError(f"verifier folder {str(folder)!r} has no usable tokenizer ({type(err).__name__}: {err}); "
                         "the prompts are text, so the verifier folder needs its tokenizer files") from None


def encode_prompts(prompts, tokenizer, chat_template, max_positions: int | None, max_new_tokens: int):
    from draftheads.data.prompts import prompt_ids

    encoded = []
    for p in prompts:
        ids = prompt_ids(p, tokenizer, chat_template)
        if not ids:
            raise UsageError(f"prompt {p.id!r} encodes to no tokens")
        if max_positions and len(ids) + max_new_tokens > max_positions:
            raise UsageError(f"prompt {p.id!r} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that "
                             f"exceeds the verifier's max_position_embeddings={max_positions}")
        encoded.append((p.id, ids))
    return encoded
