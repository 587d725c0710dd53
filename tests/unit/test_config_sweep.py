"""Every config key of every trainer, fed wrong values: each must end in one line naming the key, before anything
loads or is written.

The keys are the reference page's (draftheads/reference.py walks the dataclasses that `draftheads train` resolves);
the wrong values come from each key's type (a Literal: a value outside its choices; bool: `maybe`; int: a
non-number and -1; float: a non-number, nan, 1e999 and -1; str: the empty string; lists and tuples: a wrong element
type; Optional: the inner type's), plus EXTRA, the values outside what a key accepts that its type does not show (a
path that must exist, a name from a fixed set, a length). Each goes through `main_guard`, the trainers' own entry,
as `--section.key=VALUE`; the trainer's main must not be reached. A key that accepts any value of its type is in
FREE with the reason; a key in neither fails the completeness test, so a new key is swept or listed when it lands.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import re
import types
import typing

import pytest

from draftheads import reference

#: {key path: wrong values} beyond what the key's type gives (the same key in every trainer that has it). `{file}`
#: is replaced by an existing file, `{dir}` by an existing folder that holds nothing this key accepts. A tuple is a
#: value and the other overrides that make it wrong.
EXTRA: dict[str, tuple[str | tuple[str, ...], ...]] = {
    # paths and names
    "verifier": ("./no/such/verifier", "{file}", "not a repo id"),
    "output_dir": ("{file}",),
    "feature_cache": (("./no/such/cache", "--features=offline"), ("{dir}", "--features=offline")),
    "train.resume": ("./no/such/step-000001", "{dir}"),
    "data.source": ("./no/such/data.jsonl", "stdlib:nosplit", "hf:"),
    "data.chat_template": ("./no/such/template.jinja", "chat-ml"),
    "data.format": ("sharegpt",),  # the default source, the stdlib, is text
    "wandb.project": ("team/project", "x" * 129),
    "dflash.hidden_act": ("swishy", "gelu"),
    "dflash.layer_types": ("[global]",),
    # ranges that the type does not say
    "train.max_steps": ("0",),
    "train.batch_size": ("0",),
    "train.grad_accum": ("0",),
    "train.keep_last": ("0",),
    "train.log_every": ("0",),
    "train.max_bad_steps": ("0",),
    "train.lr": ("0", "1e39"),
    "train.betas": ("[0.9, 1.0]", "[0.9, 0.95, 0.99]"),
    "train.min_lr_ratio": ("1.5",),
    "train.warmup_steps": ("1000",),  # >= max_steps
    "train.seed": (str(2 ** 32),),
    "consistency.num_prompts": ("0",),
    "consistency.prompt_tokens": ("1",),
    "consistency.max_new_tokens": ("0",),
    "data.seq_len": ("4",),
    "data.max_rows": ("0",),
    "data.num_proc": ("0",),
    "num_speculative_tokens": ("0",),
    "eagle.layer_ids": ("[1, 2]", "[3, 2, 1]", "[1, 1, 2]", "[-1, 0, 1]"),
    "eagle.draft_vocab_size": ("0",),
    "eagle.ttt_steps": ("0", "100000"),
    "eagle.decay": ("0", "1.5"),
    "eagle.init_std": ("0",),
    "eagle.parallel_keep": ("[0.7]", "[0, 0.2]", "[0.7, 1.5]"),
    "eagle.align_topk": ("0",),
    "eagle.sliding_window": ("0",),
    "medusa.num_heads": ("0", "100000"),
    "medusa.decay": ("0", "1.5"),
    "medusa.lora_r": ("0",),
    "medusa.lora_alpha": ("0",),
    "medusa.lora_dropout": ("1",),
    "medusa.lora_target_modules": ("[]", "[q_proj, q_proj]", "['q proj']"),
    "medusa.tree_budget": ("0",),
    "medusa.tree_max_rank": ("0",),
    "dflash.num_hidden_layers": ("0",),
    "dflash.block_size": ("1", "100000"),
    "dflash.num_anchors": ("0",),
    "dflash.target_layer_ids": ("[]", "[1, 1]"),
    "dflash.init_layers": ("[0, 1]",),
    "dflash.gamma": ("0",),
    "dflash.init_std": ("0",),
    **{f"dflash.{key}": ("0",) for key in ("draft_vocab_size", "hidden_size", "intermediate_size",
                                           "num_attention_heads", "num_key_value_heads", "head_dim",
                                           "max_position_embeddings", "sliding_window", "num_target_layers",
                                           "vocab_size", "rms_norm_eps", "rope_theta")},
}

#: {key path: why any value of its type is right}
FREE: dict[str, str] = {
    "wandb.entity": "free text: a wandb team or user name (the wandb server knows which exist; empty is the default)",
    "wandb.run_name": "free text: the run's display name (empty: the output folder's name, as null)",
}


# ---- the wrong values a key's type gives ---------------------------------------------------------------------------
def type_values(kind) -> list[str]:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return [v for a in args if a is not type(None) for v in type_values(a)]
    if origin is typing.Literal:
        if all(isinstance(a, int) and not isinstance(a, bool) for a in args):
            return [str(next(i for i in range(max(args) + 2) if i not in args)), "bogus"]
        return ["bogus", ""]
    if kind is bool:
        return ["maybe"]
    if kind is int:
        return ["abc", "-1", "1.5"]
    if kind is float:
        return ["abc", "nan", "1e999", "-1"]
    if kind is str:
        return [""]
    if origin in (list, tuple):
        inner = args[0]
        example = {int: "1", float: "0.5", str: "x"}[inner]
        width = len(args) if origin is tuple and Ellipsis not in args else 1
        bad = {int: "abc", float: "abc", str: "''"}[inner]
        values = [f"[{', '.join([bad] + [example] * (width - 1))}]"]
        if inner in (int, float):
            values.append(f"[{', '.join(['-1'] + [example] * (width - 1))}]")
        return values
    raise AssertionError(f"no wrong values for the type {kind!r}: add it to type_values")


def key_type(key: reference.Key):
    module, _, name = key.owner.rpartition(".")
    return typing.get_type_hints(getattr(importlib.import_module(module), name))[key.name]


#: trainers that refuse `features: offline` as a whole (a one-line refusal of their own, in their e2e tests), so the
#: cases that need it to reach a feature_cache value cannot name that value
ONLINE_ONLY = {"mtp"}


def sweep_cases() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(trainer, key, wrong value, other overrides) for every key of every trainer but FREE's."""
    cases = []
    for trainer, (cls, _) in reference.trainers().items():
        keys, _ = reference.walk(cls)
        for key in keys:
            if key.path in FREE:
                continue
            values = [(v,) for v in type_values(key_type(key))] + [
                v if isinstance(v, tuple) else (v,) for v in EXTRA.get(key.path, ())]
            cases += [(trainer, key.path, value, tuple(more)) for value, *more in dict.fromkeys(values)
                      if not (trainer in ONLINE_ONLY and "--features=offline" in more)]
    return cases


CASES = sweep_cases()


def run_guard(trainer: str, argv: list[str]) -> tuple[int | None, str, bool]:
    """(exit code, stderr, whether the trainer's main was reached) of `draftheads train TRAINER ARGV`."""
    from draftheads import cli
    from draftheads.train.cli import main_guard

    cls, _ = cli.trainer(trainer)
    reached = []
    err = io.StringIO()
    code = None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main_guard(reached.append, cls, argv, prog=f"draftheads train {trainer}")
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue(), bool(reached)


@pytest.fixture(scope="module", autouse=True)
def one_parser_per_trainer():
    """Each trainer's jsonargparse parser built once (building it is 85% of a parse), not once per case: the cases
    parse with it as `parse_config` does. The control case below shows a reused parser still parses clean."""
    from draftheads.train import config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config, "_build_parser", functools.cache(config._build_parser))
        yield


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A folder to run in (so nothing can land in the checkout) with a file and an unrelated folder in it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file.txt").write_text("not a folder\n")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-folder" / "notes.txt").write_text("nothing a key reads\n")
    return tmp_path


def listing(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("trainer", reference.trainers())
def test_the_defaults_parse(trainer, places):
    """The control: the trainers' defaults reach main, so each sweep case's refusal is its own value's."""
    code, err, reached = run_guard(trainer, [])
    assert reached and code is None and not err


def test_every_key_is_swept_or_free():
    walked = {k.path for cls, _ in reference.trainers().values() for k in reference.walk(cls)[0]}
    swept = {path for _, path, _, _ in CASES}
    assert walked == swept | set(FREE), f"keys neither swept nor in FREE: {sorted(walked - swept - set(FREE))}"
    assert not set(FREE) & swept
    assert not set(EXTRA) - walked, f"EXTRA names keys no trainer has: {sorted(set(EXTRA) - walked)}"


@pytest.mark.parametrize("trainer, key, value, more", CASES,
                         ids=[" ".join([f"{t}-{k}={v[:40]}", *m]) for t, k, v, m in CASES])
def test_a_wrong_value_is_one_line_naming_the_key(trainer, key, value, more, places):
    value = value.replace("{file}", "a-file.txt").replace("{dir}", "a-folder")
    before = listing(places)
    code, err, reached = run_guard(trainer, [*more, f"--{key}={value}"])
    lines = err.splitlines()
    assert not reached, f"--{key}={value!r} was accepted: {trainer}'s main was reached"
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error: "), (code, err)
    assert re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", lines[0]), f"the line does not name {key}: {lines[0]}"
    assert listing(places) == before, "something was written"
