"""Data parallelism through the real launcher: `accelerate launch --multi_gpu --num_processes 2 train/X.py` (two
gloo processes on a machine without GPUs) trains the same global batch as one process, and ends with the same
weights. Also: the accelerate launch configs in configs/accelerate/ load with accelerate's own loader.

Global batch = train.batch_size x processes x train.grad_accum sequences. Two processes at batch_size B see, at each
optimizer step, the batches that one process at batch_size B and grad_accum 2 sees as its two micro-batches (the
sampler's order does not depend on the world size; process p takes batch p of every group of two), and DDP's
gradient mean equals accumulation's mean of micro-batch gradients: the weights agree to float rounding. One process
at batch_size 2B sees the same rows too, but its loss is one token-weighted mean over 2B rows instead of a mean of
two per-process means, so it agrees only approximately (measured after 4 steps: max |dw| 2e-5 for Medusa, 1e-2 for
EAGLE-3, whose per-process counts of in-draft-vocabulary targets differ more; not asserted).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.utils import free_port, save_tiny_verifier_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_configs_load(path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(path))
    expected = {"single_gpu": DistributedType.NO, "multi_gpu": DistributedType.MULTI_GPU,
                "fsdp": DistributedType.FSDP}.get(path.stem, DistributedType.DEEPSPEED)
    assert config.distributed_type == expected
    if expected == DistributedType.FSDP:
        assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
        assert config.fsdp_config["fsdp_version"] == 2  # DTensor shards: what train.placement.unsharded gathers
    if path.stem.startswith("deepspeed_zero3"):  # accelerator.get_state_dict (the export) needs the gathered weights
        assert config.deepspeed_config["zero3_save_16bit_model"] is True
    if expected == DistributedType.DEEPSPEED:
        assert config.deepspeed_config["zero_stage"] == int(path.stem.removesuffix("_cpu")[-1])


def test_all_launch_configs_are_shipped():
    assert {p.stem for p in ACCELERATE_CONFIGS} == {"single_gpu", "multi_gpu", "fsdp", "deepspeed_zero2",
                                                    "deepspeed_zero3", "deepspeed_zero2_cpu", "deepspeed_zero3_cpu"}


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    return save_tiny_verifier_with_tokenizer(tmp_path_factory.mktemp("mp-verifier") / "v")


def env():
    # ACCELERATE_USE_CPU: without it `--multi_gpu` on a GPU-less machine makes two independent runs (the trainers
    # refuse that); with it the two processes form one gloo group.
    return {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTHEADS_QUIET": "1", "WANDB_MODE": "offline",
            "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "TOKENIZERS_PARALLELISM": "false"}


def launch(script: str, processes: int, args: list[str], cwd: Path) -> None:
    launcher = Path(sys.executable).with_name("accelerate")
    head = [str(launcher), "launch", "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
    head += ["--multi_gpu", f"--num_processes={processes}", f"--main_process_port={free_port()}"] \
        if processes > 1 else ["--num_processes=1"]
    result = subprocess.run([*head, str(ROOT / "train" / script), *args], cwd=cwd, env=env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def single(script: str, args: list[str], cwd: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "train" / script), *args], cwd=cwd, env=env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def max_abs_difference(a: Path, b: Path) -> float:
    x, y = load_file(a / "drafter" / "model.safetensors"), load_file(b / "drafter" / "model.safetensors")
    assert x.keys() == y.keys()
    return max((x[k].double() - y[k].double()).abs().max().item() for k in x)


def moved(run: Path, verifier_dir: Path) -> float:
    """How far training moved the weights (so an agreement is not two untrained copies agreeing)."""
    tensors = load_file(run / "drafter" / "model.safetensors")
    return max(t.abs().max().item() for k, t in tensors.items() if "blocks" in k or "layers.0.mlp" in k
               or "midlayer.mlp" in k)


COMMON = ["--wandb.enabled=false", "--data.seq_len=32", "--data.max_rows=4", "--data.eval_rows=1",
          "--train.max_steps=4", "--train.save_every=2", "--train.log_every=1", "--train.eval_every=0",
          "--train.eval_batches=1", "--train.warmup_steps=1", "--train.mixed_precision=no"]
METHODS = {
    "medusa": ("medusa.py", ["--train.lr=0.01", "--medusa.num_heads=2", "--medusa.tree_budget=4"]),
    "eagle3": ("eagle.py", ["--config", str(ROOT / "configs/eagle3-tiny.yaml"), "--train.lr=0.003",
                            "--eagle.layer_ids=null", "--eagle.draft_vocab_size=200", "--eagle.ttt_steps=2"]),
}


@pytest.mark.parametrize("method", [*sorted(METHODS), "medusa-bf16-state", "medusa-shared"])
def test_two_processes_equal_one_with_the_same_global_batch(tmp_path, verifier_dir, method):
    """`medusa-bf16-state`: train.optimizer_state=bfloat16, whose rounding noise is the same on both processes (seeded
    by parameter and step), so the replicas stay equal and agree with accumulation as closely as fp32 state does.
    `medusa-shared`: the heads end in the verifier's lm_head, held outside DDP's parameters."""
    script, extra = METHODS[method.split("-")[0]]
    args = [*extra, f"--verifier={verifier_dir}", *COMMON]
    if method.endswith("bf16-state"):
        args.append("--train.optimizer_state=bfloat16")
    if method.endswith("shared"):
        args.append("--medusa.shared_lm_head=true")
    launch(script, 2, [*args, f"--output_dir={tmp_path / 'ddp'}", "--train.batch_size=2"], tmp_path)
    single(script, [*args, f"--output_dir={tmp_path / 'accum'}", "--train.batch_size=2", "--train.grad_accum=2"],
           tmp_path)

    exact = max_abs_difference(tmp_path / "ddp", tmp_path / "accum")
    print(f"[{method}] 2 processes x batch 2 vs 1 process x batch 2 x grad_accum 2: max |dw| = {exact:.3g}")
    assert moved(tmp_path / "ddp", verifier_dir) > 1e-3
    assert exact <= 1e-6
    # both ranks wrote their RNG state into the checkpoint; the second process's is what a resume restores
    assert {p.name for p in (tmp_path / "ddp" / "step-000004").glob("random_states_*.pkl")} == {
        "random_states_0.pkl", "random_states_1.pkl"}


def test_multi_gpu_launch_without_gpus_and_without_cpu_flag_is_refused(tmp_path, verifier_dir):
    launcher = Path(sys.executable).with_name("accelerate")
    environment = {k: v for k, v in env().items() if k != "ACCELERATE_USE_CPU"}
    if torch.cuda.device_count() >= 2:
        pytest.skip("GPUs present: --multi_gpu is real DDP here")
    result = subprocess.run([str(launcher), "launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
                             f"--main_process_port={free_port()}",
                             "--mixed_precision=no", "--dynamo_backend=no", str(ROOT / "train/medusa.py"),
                             f"--verifier={verifier_dir}", f"--output_dir={tmp_path / 'x'}", *COMMON],
                            cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "ACCELERATE_USE_CPU=true" in result.stderr
