"""What an evaluation writes: results.json, report.md, PNG plots, and the same to wandb.

    results = build_results(runs, prompts_spec=..., config=..., environment=environment(...))
    write_report(results, out_dir)             # results.json, report.md, accepted_length.png,
                                               # per_position_acceptance.png, tokens_per_s.png
    log_wandb(results, out_dir, project=...)   # metrics, a table and the images (offline without an API key)

results.json:
    config       the exact command line and every setting
    environment  versions, threads, device, dtype, CPU, load average, git commit
    baseline     the label the speedups are over (`autoregressive`)
    summary      per method label: tau, acceptance_rate, per_position_acceptance, accepted_length_histogram,
                 verifier_calls, new_tokens, seconds, tokens_per_s, speedup, efficiency, lossless, drafter, ...
    samples      one per prompt: id, prompt_ids, and per method label its output_ids and accepted counts per
                 verifier call (`runs`); `output_ids` / `accepted` at the top are the first method's
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from draftheads.eval.measure.metrics import MethodRun, summarize
from draftheads.models.atomic import write_json

BASELINE = "autoregressive"
PLOTS = ("accepted_length.png", "per_position_acceptance.png", "tokens_per_s.png")


# ---- environment -------------------------------------------------------------------------------------------------
def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]  # the checkout (eval/measure/ -> eval/ -> the root)
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device=None, dtype=None) -> dict:
    """Where the numbers were measured (a speedup means little without it)."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    env = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": _version("transformers"),
        "draftheads_commit": _git_commit(), "platform": platform.platform(), "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "device": str(dev), "dtype": str(dtype or ""),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
    return env


# ---- results -----------------------------------------------------------------------------------------------------
def build_results(runs: list[MethodRun], config: dict, environment: dict, baseline: str = BASELINE,
                  primary: str | None = None) -> dict:
    """The results.json document. `runs` must include the baseline label (speedups are over it); `primary` (default
    the first run) is the method whose outputs sit at the top of each sample."""
    by_label = {r.label: r for r in runs}
    if baseline not in by_label:
        raise ValueError(f"no {baseline!r} run among {list(by_label)}: the speedup needs it")
    base = by_label[baseline]
    prompt_ids = [(s.prompt_id, s.prompt_ids) for s in base.samples]
    for run in runs:
        if [(s.prompt_id, s.prompt_ids) for s in run.samples] != prompt_ids:
            raise ValueError(f"run {run.label!r} decoded other prompts than {baseline!r}")
    summary = {r.label: summarize(r, base) for r in runs}
    first = by_label[primary] if primary is not None else runs[0]
    samples = []
    for i, (pid, ids) in enumerate(prompt_ids):
        per_run = {r.label: {"output_ids": r.samples[i].output_ids, "accepted": r.samples[i].accepted}
                   for r in runs}
        samples.append({"id": pid, "prompt_ids": ids, "method": first.label,
                        "output_ids": first.samples[i].output_ids, "accepted": first.samples[i].accepted,
                        "runs": per_run})
    return {"config": config, "environment": environment, "baseline": baseline, "summary": summary,
            "samples": samples}


def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def summary_table(summary: dict) -> str:
    """The markdown table printed by the CLI and put in report.md."""
    lines = ["| method | tau | draft accept | verifier calls | tokens/s | speedup | efficiency | lossless |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for label, row in summary.items():
        lines.append(f"| {label} | {_fmt(row['tau'])} | {_fmt(row['acceptance_rate'])} | "
                     f"{_fmt(row['verifier_calls'])} | {_fmt(row['tokens_per_s'], 1)} | "
                     f"{_fmt(row['speedup'])}x | {_fmt(row['efficiency'])} | {_fmt(row['lossless'])} |")
    return "\n".join(lines)


def position_table(summary: dict) -> str:
    rows = {k: v["per_position_acceptance"] for k, v in summary.items() if v.get("per_position_acceptance")}
    if not rows:
        return ""
    depth = max(map(len, rows.values()))
    lines = ["| method | " + " | ".join(f"k={k}" for k in range(1, depth + 1)) + " |",
             "|---|" + "---:|" * depth]
    for label, values in rows.items():
        cells = [_fmt(values[k]) if k < len(values) else "" for k in range(depth)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(results: dict) -> str:
    cfg, env, summary = results["config"], results["environment"], results["summary"]
    s = cfg.get("settings", {})
    num = len(results["samples"])
    lines = [f"# Speculative decoding: {cfg.get('verifier', '?')} on {cfg.get('prompts', '?')}", "",
             f"`{cfg.get('command', '')}`", "",
             f"{num} prompts, up to {s.get('max_new_tokens')} new tokens, temperature {s.get('temperature')}, "
             f"top-p {s.get('top_p')}, batch size {s.get('batch_size')}, seed {s.get('seed')}, "
             f"{s.get('repeats', 1)} timed repeat(s) per batch; {env.get('device')} {env.get('dtype')}, "
             f"{env.get('torch_threads')} torch thread(s) on {env.get('cpu_count')} CPUs ({env.get('cpu')}), "
             f"load average {env.get('load_average')}.", "",
             summary_table(summary), ""]
    positions = position_table(summary)
    if positions:
        lines += ["Per-position acceptance (fraction of verifier calls whose accepted length reached k):", "",
                  positions, ""]
    lines += ["![accepted length](accepted_length.png) ![per-position acceptance](per_position_acceptance.png) "
              "![tokens/s](tokens_per_s.png)", "",
              "- **tau**: mean tokens per verifier call, the bonus / corrected token included (vLLM's acceptance "
              "length); 1 for plain decoding. HF assisted generation: new tokens / verifier forwards.",
              "- **draft accept**: accepted / proposed draft tokens.",
              f"- **speedup**: tokens/s over `{results['baseline']}` tokens/s, same prompts, same run "
              "(methods take turns batch by batch); wall clock of whole generate calls, prefill included.",
              "- **efficiency** = speedup / tau: 1.0 if drafting and verifying a draft cost nothing.",
              "- **lossless**: greedy output equals the verifier's own greedy decoding, sampled output follows "
              "its distribution (`draftheads recheck results.json` re-checks greedy outputs).", "",
              "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if v not in (None, "")), ""]
    drafters = {k: v.get("drafter") for k, v in summary.items() if v.get("drafter")}
    if drafters:
        lines += ["Drafters:", ""] + [f"- `{k}`: {json.dumps(v)}" for k, v in drafters.items()] + [""]
    return "\n".join(lines)


# ---- plots -------------------------------------------------------------------------------------------------------
def write_plots(summary: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, path: Path) -> Path:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    out_dir = Path(out_dir)
    paths = []
    spec = {k: v for k, v in summary.items() if v.get("accepted_length_histogram") and v.get("max_depth")}

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(spec), 1)
    for i, (label, row) in enumerate(spec.items()):
        hist = row["accepted_length_histogram"]
        total = sum(hist) or 1
        ax.bar([j + 1 + (i - (len(spec) - 1) / 2) * width for j in range(len(hist))], [h / total for h in hist],
               width=width, label=f"{label} (tau {row['tau']:.2f})")
    ax.set_xlabel("tokens per verifier call (accepted drafts + 1)")
    ax.set_ylabel("fraction of verifier calls")
    ax.set_title("Accepted length")
    if spec:
        ax.legend()
    paths.append(save(fig, out_dir / PLOTS[0]))

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, row in spec.items():
        values = row["per_position_acceptance"]
        ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accepted length >= k)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Per-position acceptance")
    if spec:
        ax.legend()
    paths.append(save(fig, out_dir / PLOTS[1]))

    fig, ax = plt.subplots(figsize=(7, 0.5 * len(summary) + 1.5))
    labels = list(summary)
    values = [summary[k]["tokens_per_s"] or 0.0 for k in labels]
    colour = {BASELINE: "#888888", "hf": "#e08a3c", "hf-assisted": "#e08a3c"}
    bars = ax.barh(labels, values, color=[colour.get(summary[k]["method"], "#3b75af") for k in labels])
    for bar, k in zip(bars, labels):
        up = summary[k]["speedup"]
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {up:.2f}x" if up else "", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("new tokens / s")
    ax.set_title("Throughput (speedup over autoregressive)")
    ax.set_xlim(0, max(values + [1.0]) * 1.2)
    paths.append(save(fig, out_dir / PLOTS[2]))
    return paths


def write_report(results: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """results.json, report.md and the plots into out_dir (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"results": out / "results.json", "report": out / "report.md"}
    write_json(paths["results"], results)
    for p in write_plots(results["summary"], out):
        paths[p.stem] = p
    paths["report"].write_text(markdown_report(results))
    return paths


def read_results(path: str | os.PathLike) -> dict:
    """A results.json (or the folder holding one), checked for what the re-check reads; DataError names the file."""
    from draftheads.data.config import DataError

    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise DataError(f"{path}: no such results file (written by `draftheads eval --out DIR`)")
    try:
        results = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err}); the file is truncated or was edited: run the eval "
                        "again") from None
    for keys in (("config",), ("summary",), ("samples",), ("config", "settings"),
                 ("config", "settings", "temperature"), ("config", "settings", "max_new_tokens")):
        value = results
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            raise DataError(f"{path}: no `{'.'.join(keys)}`; expected a results.json written by `draftheads eval`")
    return results


# ---- wandb -------------------------------------------------------------------------------------------------------
SCALARS = ("tau", "acceptance_rate", "verifier_calls", "new_tokens", "tokens_per_s", "speedup", "efficiency")


def log_wandb(results: dict, out_dir: str | os.PathLike, project: str | None = None, name: str | None = None,
              mode: str | None = None) -> str:
    """Log the summary as metrics (`<label>/tau`, ...), a table, and the plots; returns the run's folder. `mode`: as
    settled by `wandb_check.prepare_wandb` before the run (default: `wandb_mode()`)."""
    import wandb

    from draftheads.eval.measure.wandb_check import wandb_mode

    out = Path(out_dir)
    run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "draftheads-eval",
                     name=name or out.name, dir=str(out), mode=mode or wandb_mode(), config=results["config"],
                     job_type="eval", reinit="finish_previous")
    try:
        summary = results["summary"]
        metrics = {f"{label}/{key}": row[key] for label, row in summary.items() for key in SCALARS
                   if row.get(key) is not None}
        for label, row in summary.items():
            for k, p in enumerate(row.get("per_position_acceptance") or [], 1):
                metrics[f"{label}/accept_pos{k}"] = p
        columns = ["method", *SCALARS, "lossless", "per_position_acceptance"]
        table = wandb.Table(columns=columns, data=[
            [label, *(row.get(k) for k in SCALARS), row["lossless"], json.dumps(row.get("per_position_acceptance"))]
            for label, row in summary.items()])
        images = {f"plots/{Path(p).stem}": wandb.Image(str(out / p)) for p in PLOTS if (out / p).is_file()}
        run.log({**metrics, "summary_table": table, **images})
        run.summary.update(metrics)
        run.config.update({"environment": results["environment"]}, allow_val_change=True)
        return str(Path(run.dir).parent)
    finally:
        run.finish()


def command_line(argv: list[str], program: str = "draftheads eval") -> str:
    """The command as a shell would take it back."""
    import shlex

    return " ".join([program, *(shlex.quote(a) for a in argv)])
