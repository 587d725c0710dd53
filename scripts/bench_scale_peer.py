"""One peer trainer's steps, measured for the scale bench (scripts/bench_scale.py) in the peer's own environment.

    .venv-speculators/bin/python scripts/bench_scale_peer.py SPEC.json
    SPECFORGE_DEVICE=cpu TORCHDYNAMO_DISABLE=1 .venv-specforge/bin/python scripts/bench_scale_peer.py SPEC.json

SPEC.json (written by the bench): {peer: speculators | specforge, flags (speculators' `train` flags) or run_yaml
(SpecForge's run config), warmup, steps, threads, device, report}. The peer's own training command runs in this
process (`speculators train FLAGS`, `specforge train -c RUN.yaml`) on the bench's offline features, with the
run-time patches its CPU runner in eval/interop/ applies on a CPU (each explained there), and the bench's meter
(scripts/scale_meter.py, the same as for our trainers) marks each optimizer step; after the warm-up and the measured
steps it ends the loop. The peer's model (and SpecForge's target head) are handed to the meter for the static
memory. Any error ends in one line in the report (the table shows it). Imports nothing of draftheads.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

INTEROP = Path(__file__).resolve().parents[1] / "eval" / "interop"


def runner(name: str):
    """A peer's CPU runner from eval/interop/ (it runs in the peer's environment too), loaded from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, INTEROP / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_speculators(spec: dict, meter) -> None:
    import speculators.train.trainer as trainer

    if spec["device"] == "cpu":
        runner("speculators_runner").patch_for_cpu()
    original = trainer.Trainer.__init__

    def init(self, model, *args, **kwargs):  # the draft model, as the trainer receives it
        meter.watch(model)
        original(self, model, *args, **kwargs)

    trainer.Trainer.__init__ = init
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(spec["flags"]))


def run_specforge(spec: dict, meter) -> int:
    from specforge.modeling.target.target_head import TargetHead
    cpu_runner = runner("specforge_runner")
    if spec["device"] == "cpu":  # no Triton: its KL kernel, eagerly
        cpu_runner.eager_kl_loss()
    cast = TargetHead.__dict__["from_pretrained"]
    # the runner's lm_head reading from a one-file model.safetensors (the stand-in has no index.json), but the
    # head kept in bf16, as SpecForge casts it: the features are bf16 here
    cpu_runner.float32_target_head()
    TargetHead.from_pretrained = cast
    from specforge.training.trainer import Trainer

    original = Trainer.__init__

    def init(self, *args, **kwargs):  # its draft model and the verifier's head it computes the targets with
        meter.watch(kwargs.get("model"), kwargs.get("target_head"))
        original(self, *args, **kwargs)

    Trainer.__init__ = init
    from specforge.cli import main as specforge

    return specforge(["train", "-c", spec["run_yaml"]])


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: bench_scale_peer.py SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    import torch

    from scale_meter import Enough, StepMeter, write_failure  # this script's folder is on the path

    torch.set_num_threads(spec["threads"])
    meter = StepMeter(spec["warmup"], spec["steps"]).install()
    extra = {"tokens_per_step": spec["seq"]}
    try:
        code = (run_speculators if spec["peer"] == "speculators" else run_specforge)(spec, meter)
    except Enough:
        code = 0
    except torch.OutOfMemoryError as err:
        write_failure(spec["report"], f"did not fit: CUDA out of memory ({err})", {**extra, "did_not_fit": True})
        return 0
    except BaseException as err:  # the peer's own failure: one line for the table, the traceback for the log
        traceback.print_exc()
        inner = Enough in {type(e) for e in _chain(err)}
        if not inner:
            write_failure(spec["report"], f"{spec['peer']}: {type(err).__name__}: {err}", extra)
            return 0
        code = 0
    if not meter.done:
        write_failure(spec["report"], f"{spec['peer']} stopped after {len(meter.marks)} of "
                                      f"{spec['warmup'] + spec['steps']} steps (exit {code})", extra)
        return 0
    meter.write(spec["report"], extra)
    return 0


def _chain(err: BaseException):
    """The exception and those it was raised from or during (a peer may wrap our stop signal)."""
    seen = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
