"""`draftheads build-verifier` (also `python -m draftheads.models.tiny`): build, locate or sample an embedded
verifier."""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path

import torch

from draftheads.models.tiny.cache import _transformers_bars_off, build, ensure_built, read_build_info
from draftheads.models.tiny.pretrain import _cpu_count, build_device
from draftheads.models.tiny.recipe import RECIPES, Recipe, get_recipe


@torch.no_grad()
def greedy_generate(folder: str | Path, prompts: list[str], max_new_tokens: int = 64) -> list[str]:
    """Greedy continuations (text after each prompt) from a model folder, with plain HF `generate`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    with _transformers_bars_off():
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids  # (1, T)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


# ---- CLI --------------------------------------------------------------------------------------------------------------
def summary(folder: str | Path) -> str:
    info = read_build_info(folder) or {}
    fig, held = info.get("figures", {}), info.get("held_out", {})
    lines = [f"{info.get('recipe_name', '?')} (seed {info.get('seed')}): {folder}"]
    if held:
        lines.append(f"  held-out bits per byte: {held['bits_per_byte']:.4f} "
                     f"({held['nats_per_token']:.4f} nats/token over {held['files']} eval files, "
                     f"{held['tokens']} tokens, {held['bytes']} bytes)")
    if fig:
        where = f"{fig['threads']} threads" if fig.get("device", "cpu") == "cpu" else f"on {fig['device']}"
        lines.append(f"  training: {fig['train_tokens']} tokens at {fig['train_tokens_per_s']:.0f} tokens/s "
                     f"({fig['steps_per_s']:.2f} steps/s, {fig['precision']}, {where}), "
                     f"final train loss {fig['train_loss']:.4f} nats/token")
        lines.append(f"  build time: {fig['total_seconds']:.0f}s (tokenizer {fig['tokenizer_seconds']:.1f}s, "
                     f"training {fig['train_seconds']:.0f}s, held-out eval {held.get('seconds', 0):.0f}s)")
        if fig.get("fastest_steps_per_s"):
            quiet = fig["total_seconds"] - fig["train_seconds"] + info["recipe"]["steps"] / fig["fastest_steps_per_s"]
            cpu = (f"training used {fig['train_cpu_seconds']:.0f} CPU-seconds on {fig['threads']} threads; "
                   if "train_cpu_seconds" in fig else "")
            lines.append(f"  load average {fig['load_average'][0]} -> {fig['load_average'][1]} (CPUs: {_cpu_count()}); "
                         f"{cpu}at its fastest interval ({fig['fastest_steps_per_s']:.2f} steps/s) the build would "
                         f"take {quiet:.0f}s")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m draftheads.models.tiny", description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", prog="draftheads build-verifier",  # the verb runs this subcommand
                       help="build a recipe (into the cache unless --out; a current cached build is kept)")
    p = sub.add_parser("path", help="print the cached folder of a recipe, building it first if needed")
    g = sub.add_parser("generate", help="greedy continuations of prompts (building the recipe first if needed)")
    g.add_argument("prompts", nargs="+", help="prompt texts; \\n and \\t escapes are expanded")
    g.add_argument("--max-new-tokens", type=int, default=64)
    for s in (b, p, g):
        s.add_argument("--recipe", default="default", choices=sorted(RECIPES))
        s.add_argument("--recipe-json", default=None, help="a whole Recipe as JSON (overrides --recipe)")
        s.add_argument("--home", default=None, help="cache folder (default $DRAFTHEADS_HOME or ~/.cache/draftheads)")
    b.add_argument("--out", default=None, help="write the model folder here instead of the cache")
    b.add_argument("--seed", type=int, default=None, help="default 0 (a cached build of any seed is kept)")
    b.add_argument("--force", action="store_true", help="rebuild even if the cached build is current")
    b.add_argument("--device", default="cpu", help="where to train: cpu (default) or cuda[:N]")
    b.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="sets",
                   help="replace one recipe field (repeatable; VALUE is JSON, else a string), e.g. --set steps=10")
    return top


def recipe_overrides(recipe: Recipe, sets: list[str]) -> dict:
    """`--set FIELD=VALUE` pairs as overrides of `recipe`'s fields; VALUE is read as JSON (10, 1e-3, null, true),
    else kept as a string, and must have the field's type (ints for floats too; null where the field may be None)."""
    hints = typing.get_type_hints(Recipe)  # every field's type
    out = {}
    for item in sets:
        field, eq, raw = item.partition("=")
        if not eq or not field:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set steps=10")
        if field not in hints:
            raise ValueError(f"--set {item!r}: no recipe field {field!r}; expected one of {sorted(hints)}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        hint = hints[field]
        allowed = set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        ok = ((value is None and type(None) in allowed)
              or (int in allowed and type(value) is int)
              or (float in allowed and type(value) in (int, float))
              or (bool in allowed and type(value) is bool)
              or (str in allowed and isinstance(value, str) and value != "")
              or (choices is not None and value in choices))
        if not ok:
            kind = " or ".join(map(repr, choices)) if choices else " | ".join(
                "None" if t is type(None) else t.__name__ for t in typing.get_args(hint) or (hint,))
            raise ValueError(f"--set {item!r}: field {field!r} takes {kind} (now {getattr(recipe, field)!r}), "
                             f"not {value!r}")
        out[field] = value
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    recipe = Recipe(**json.loads(args.recipe_json)) if args.recipe_json else args.recipe
    if args.command == "build":
        try:
            device = build_device(args.device)
            if (args.sets or device.type != "cpu") and not args.out:
                # the cache keeps each named recipe as it is, built on a CPU (the same bytes for a seed there)
                raise ValueError(f"{'--set' if args.sets else '--device ' + args.device} builds something other "
                                 "than the cached recipe: give --out DIR")
            if args.sets:
                base = get_recipe(recipe)
                recipe = get_recipe(base, **recipe_overrides(base, args.sets))
        except (ValueError, TypeError) as err:  # a bad --device, field or value: one line
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.command == "path":
        print(ensure_built(recipe, home=args.home))
        return 0
    if args.command == "generate":
        prompts = [p.replace("\\n", "\n").replace("\\t", "\t") for p in args.prompts]
        for prompt, text in zip(prompts, greedy_generate(ensure_built(recipe, home=args.home), prompts,
                                                         args.max_new_tokens)):
            print(f"--- {prompt!r}\n{prompt}{text}\n")
        return 0
    if args.out:
        from draftheads.models.outputs import OutputInTheWay, claim_output

        try:  # the build replaces --out whole: never a folder that holds something else
            claim_output(args.out, "verifier", "--out")
        except OutputInTheWay as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        folder = build(recipe, args.out, seed=args.seed or 0, device=device)
    else:
        folder = ensure_built(recipe, home=args.home, seed=args.seed, force=args.force)  # on the CPU (see above)
    print(summary(folder))
    return 0
