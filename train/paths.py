"""The paths a training run reads, checked before anything is written or loaded: the verifier, the data source and
chat template, the checkpoint to resume from, the feature cache (offline), and that output_dir can be a folder.

Offline (`features: offline`) the rows come from the cache, so the data files are not looked for.

`main_guard` (train/cli.py) calls `check_paths` right after parsing, and `claim` (train/run_folder.py) before it
takes the run folder, so a path that is not there ends in one line naming its key, not after the verifier has
loaded. Only what a stat or the cache's small index shows: contents are checked where they are read. Not a check of
the config classes themselves: `draftheads dump-features` reads the same config to write the cache it names.
"""

from __future__ import annotations

from draftheads.data.config import chat_template_problem, source_problem
from draftheads.data.hidden_states import CacheError, read_index
from draftheads.models.atomic import folder_problem
from draftheads.models.verifier import verifier_problem
from draftheads.train.checkpoint import resolve_resume
from draftheads.train.config import ConfigError


def check_paths(cfg) -> None:
    """Every path the run reads is there as what it should be, and output_dir can become a folder; else a
    ConfigError names the key. Writes nothing."""
    template = cfg.data.chat_template
    online = cfg.features == "online"  # offline, the cache holds the rows: the data files may be gone since the dump
    problem = (verifier_problem(cfg.verifier)
               or folder_problem(cfg.output_dir, f"output_dir={cfg.output_dir!r}", create=False)
               or (source_problem(cfg.data.source) if online else None)
               or (chat_template_problem(template) if online and template is not None else None))
    if problem:
        raise ConfigError(problem)
    if cfg.train.resume not in ("auto", "none"):
        resolve_resume(cfg.train.resume, cfg.output_dir)  # a bad checkpoint path stops now, not after the data loads
    if cfg.features == "offline":
        try:
            read_index(cfg.feature_cache)
        except CacheError as err:
            message = str(err) if "feature_cache" in str(err) else f"feature_cache={cfg.feature_cache!r}: {err}"
            raise ConfigError(message) from None
