"""DeepSpeed ZeRO-2 and ZeRO-3 through the real launcher on a machine without GPUs: `accelerate launch --config_file
configs/accelerate/deepspeed_zero{2,3}_cpu.yaml train/eagle.py` (two processes, gloo, DeepSpeed's CPU accelerator).

Each stage trains EAGLE-3 on a tiny verifier for 4 steps, is killed (SIGKILL of the main process while it writes
the step-4 checkpoint) and resumed from step 2 by the same command, and must then agree with an uninterrupted DDP run
at the same seed and global batch (2 processes x batch 2): the same per-step losses and the same exported weights
(measured: ZeRO-2 bit-equal, ZeRO-3 within 1e-6, its reduce-scatter summing in another order). That the DeepSpeed
engine trained, not DDP standing in, is read from the run: the trainer's `[deepspeed] DeepSpeedEngine ZeRO-N` line
(the prepared model's own class and stage) and DeepSpeed's checkpoint files (one optimizer shard per process; under
ZeRO-3 one weight shard per process too). The export (under ZeRO-3 gathered from the shards) must equal the
checkpoint's weights consolidated by DeepSpeed's own zero_to_fp32. Launches a DeepSpeed config would silently not
honour are refused in one line (ACCELERATE_USE_CPU turning it into DDP; a gradient_clipping that is not
train.grad_clip).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.test_multiprocess import COMMON, METHODS, env, max_abs_difference, moved
from tests.utils import free_port, save_tiny_verifier_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]
STAGES = (2, 3)


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    return save_tiny_verifier_with_tokenizer(tmp_path_factory.mktemp("ds-verifier") / "v")


def deepspeed_env(**extra) -> dict:
    environment = {k: v for k, v in env().items() if k != "ACCELERATE_USE_CPU"}  # it would make the launch DDP
    return {**environment, **extra}


def eagle_args(verifier_dir: Path, out: Path) -> list[str]:
    script, extra = METHODS["eagle3"]
    return [str(ROOT / "train" / script), *extra, f"--verifier={verifier_dir}", *COMMON, f"--output_dir={out}",
            "--train.batch_size=2", "--train.grad_clip=0.5"]


def launch(head: list[str], args: list[str], cwd: Path, environment: dict) -> subprocess.CompletedProcess:
    launcher = Path(sys.executable).with_name("accelerate")
    return subprocess.run([str(launcher), "launch", *head, *args], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=300)


def deepspeed_launch(stage: int, args: list[str], cwd: Path, processes: int = 2,
                     **extra) -> subprocess.CompletedProcess:
    config = ROOT / "configs" / "accelerate" / f"deepspeed_zero{stage}_cpu.yaml"
    return launch(["--config_file", str(config), f"--num_processes={processes}"], args, cwd, deepspeed_env(**extra))


def losses(run: Path) -> dict[int, list[float]]:
    """Every logged train/loss of a run folder, per step (a resumed run logs the steps after its checkpoint again)."""
    found: dict[int, list[float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            found.setdefault(record["step"], []).append(record["train/loss"])
    return found


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, verifier_dir):
    """The reference: plain DDP, 2 processes x batch 2, uninterrupted."""
    root = tmp_path_factory.mktemp("ds-ddp")
    head = ["--multi_gpu", "--num_processes=2", "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
            f"--main_process_port={free_port()}"]
    result = launch(head, eagle_args(verifier_dir, root / "run"), root, env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "[deepspeed]" not in result.stdout
    return root / "run"


@pytest.fixture(scope="module", params=STAGES, ids=lambda s: f"zero{s}")
def zero_run(request, tmp_path_factory, verifier_dir):
    """A ZeRO run killed while writing its step-4 checkpoint, then resumed by the same command: (stage, run folder,
    the resumed launch's stdout)."""
    stage = request.param
    root = tmp_path_factory.mktemp(f"ds-zero{stage}")
    args = eagle_args(verifier_dir, root / "run")
    killed = deepspeed_launch(stage, args, root, DRAFTHEADS_TEST_CHECKPOINT_KILL="4:before_marker")
    assert killed.returncode != 0, killed.stdout[-2000:] + killed.stderr[-4000:]
    assert (root / "run" / "step-000002" / "COMPLETE").is_file()
    assert not (root / "run" / "step-000004").exists() and (root / "run" / ".step-000004.tmp").is_dir()
    resumed = deepspeed_launch(stage, args, root)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    return stage, root / "run", resumed.stdout


def test_the_deepspeed_engine_trains(zero_run):
    stage, run, stdout = zero_run
    optimizer = {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}[stage]
    line = next((line for line in stdout.splitlines() if line.startswith("[deepspeed]")), None)
    assert line is not None and line.startswith(f"[deepspeed] DeepSpeedEngine ZeRO-{stage}, {optimizer} over 2 "
                                                "processes (gloo)"), stdout[-2000:]
    shards = {p.name for p in (run / "step-000004" / "pytorch_model").iterdir()}
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)} <= shards  # one optimizer shard each
    if stage == 3:  # the weights themselves sharded: half of them on each process, one file each
        held, total = (int(n) for n in line.split("holds ")[1].split(" weights")[0].split(" of "))
        assert 0 < held < total and abs(2 * held - total) <= 2
        assert {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)} <= shards
    else:
        assert "mp_rank_00_model_states.pt" in shards


def test_killed_and_resumed_run_equals_ddp(zero_run, ddp, verifier_dir):
    stage, run, _ = zero_run
    ours, reference = losses(run), losses(ddp)
    assert sorted(ours) == sorted(reference) == [1, 2, 3, 4]
    # the resume continued from step-000002: steps 3 and 4 were logged by both launches, steps 1 and 2 only once
    assert [len(ours[s]) for s in (1, 2, 3, 4)] == [1, 1, 2, 2]
    for step, values in ours.items():
        for value in values:
            assert value == pytest.approx(reference[step][0], rel=1e-5, abs=1e-6), (step, values, reference[step])
    difference = max_abs_difference(run, ddp)
    print(f"[zero{stage}] killed at step 4, resumed from 2, vs DDP uninterrupted: max |dw| = {difference:.3g}")
    assert moved(ddp, verifier_dir) > 1e-3
    assert difference <= 1e-5


def test_export_is_the_checkpoint_consolidated(zero_run):
    """The export (under ZeRO-3 gathered from the processes' shards) holds exactly the fp32 weights that DeepSpeed's
    zero_to_fp32 rebuilds from the last checkpoint's per-process partitions."""
    _, run, _ = zero_run
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(run / "step-000004"), tag="pytorch_model")
    consolidated = {k.removeprefix("drafter."): v for k, v in consolidated.items()}
    exported = load_file(run / "drafter" / "model.safetensors")
    assert exported.keys() == consolidated.keys()
    for name, tensor in exported.items():
        assert tensor.shape == consolidated[name].shape, name
        assert torch.equal(tensor, consolidated[name].to(tensor.dtype)), name


def test_ddp_standing_in_for_deepspeed_is_refused(tmp_path, verifier_dir):
    """ACCELERATE_USE_CPU=true makes Accelerate set up DDP under a DeepSpeed launch config (one process is enough to
    see it: Accelerate then sets up MULTI_CPU instead of DEEPSPEED)."""
    result = deepspeed_launch(2, eagle_args(verifier_dir, tmp_path / "run"), tmp_path, processes=1,
                              ACCELERATE_USE_CPU="true")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("config error:")]
    assert lines and "asks for DeepSpeed but Accelerate set up" in lines[0] and "ACCELERATE_USE_CPU" in lines[0]
    assert "[rank0]: Traceback" not in result.stderr  # the trainer's one line, not an exception from inside
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_launch_config_clipping_otherwise_is_refused_naming_the_file(tmp_path, verifier_dir):
    config = tmp_path / "zero2-clip.yaml"
    text = (ROOT / "configs" / "accelerate" / "deepspeed_zero2_cpu.yaml").read_text()
    config.write_text(text.replace("deepspeed_config:\n", "deepspeed_config:\n  gradient_clipping: 1.0\n"))
    result = launch(["--config_file", str(config), "--num_processes=1"], eagle_args(verifier_dir, tmp_path / "run"),
                    tmp_path, deepspeed_env())
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("config error:")]
    assert lines, result.stderr[-3000:]
    assert f"{config}: deepspeed_config.gradient_clipping=1.0 but train.grad_clip=0.5" in lines[0]


def test_cpu_launch_configs_match_the_gpu_ones():
    """The CPU configs differ from the GPU ones only in where they run, not in what DeepSpeed does."""
    from accelerate.commands.config.config_args import load_config_from_file

    for stage in STAGES:
        gpu = load_config_from_file(str(ROOT / "configs" / "accelerate" / f"deepspeed_zero{stage}.yaml"))
        cpu = load_config_from_file(str(ROOT / "configs" / "accelerate" / f"deepspeed_zero{stage}_cpu.yaml"))
        assert cpu.deepspeed_config == gpu.deepspeed_config
        assert cpu.num_processes == 2 and not cpu.use_cpu


def test_bf16_optimizer_state_under_zero2_resumes_exactly(tmp_path, verifier_dir):
    """train.optimizer_state=bfloat16 under ZeRO-2: DeepSpeed hands the client optimizer (CompactAdamW) its flat fp32
    partitions, and saves and restores its state with the checkpoint; a run killed while writing step 4 and resumed
    from step 2 ends with the weights of the same run uninterrupted, and the moments in the optimizer shards are
    bf16."""
    args = [*eagle_args(verifier_dir, tmp_path / "killed"), "--train.optimizer_state=bfloat16"]
    killed = deepspeed_launch(2, args, tmp_path, DRAFTHEADS_TEST_CHECKPOINT_KILL="4:before_marker")
    assert killed.returncode != 0, killed.stdout[-2000:] + killed.stderr[-4000:]
    resumed = deepspeed_launch(2, args, tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    straight_args = [*eagle_args(verifier_dir, tmp_path / "straight"), "--train.optimizer_state=bfloat16"]
    straight = deepspeed_launch(2, straight_args, tmp_path)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-4000:]
    assert "[deepspeed] DeepSpeedEngine ZeRO-2" in resumed.stdout
    assert max_abs_difference(tmp_path / "killed", tmp_path / "straight") == 0.0
    assert moved(tmp_path / "straight", verifier_dir) > 1e-3
    shard_file = tmp_path / "killed" / "step-000004" / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard = torch.load(shard_file, weights_only=False)  # DeepSpeed's own file, written by this test's run
    moments = list(tensors_named(shard["optimizer_state_dict"]["base_optimizer_state"], ("exp_avg", "exp_avg_sq")))
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}


def tensors_named(tree, keys: tuple[str, ...]):
    """The tensors under any of `keys` anywhere in nested dicts and lists (DeepSpeed's optimizer shard)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in keys and torch.is_tensor(value):
                yield value
            else:
                yield from tensors_named(value, keys)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors_named(value, keys)


def test_medusa_shared_head_under_zero3_equals_ddp(tmp_path, verifier_dir):
    """medusa.shared_lm_head under ZeRO-3: the held head is no parameter, so DeepSpeed partitions the ResBlocks alone;
    the losses and the gathered export equal DDP's, and the export carries the verifier's head."""
    from draftheads.models.export import load_medusa
    from draftheads.models.verifier import Verifier

    script, extra = METHODS["medusa"]

    def args(out):
        return [str(ROOT / "train" / script), *extra, f"--verifier={verifier_dir}", *COMMON, f"--output_dir={out}",
                "--train.batch_size=2", "--medusa.shared_lm_head=true"]

    zero = deepspeed_launch(3, args(tmp_path / "zero3"), tmp_path)
    assert zero.returncode == 0, zero.stdout[-2000:] + zero.stderr[-4000:]
    assert "[deepspeed] DeepSpeedEngine ZeRO-3" in zero.stdout
    head = ["--multi_gpu", "--num_processes=2", "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
            f"--main_process_port={free_port()}"]
    ddp_run = launch(head, args(tmp_path / "ddp"), tmp_path, env())
    assert ddp_run.returncode == 0, ddp_run.stdout[-2000:] + ddp_run.stderr[-4000:]
    ours, reference = losses(tmp_path / "zero3"), losses(tmp_path / "ddp")
    assert sorted(ours) == sorted(reference) == [1, 2, 3, 4]
    for step, values in ours.items():
        assert values[0] == pytest.approx(reference[step][0], rel=1e-5, abs=1e-6), step
    assert max_abs_difference(tmp_path / "zero3", tmp_path / "ddp") <= 1e-5
    assert moved(tmp_path / "ddp", verifier_dir) > 1e-3
    verifier = Verifier.from_pretrained(verifier_dir)
    heads, _ = load_medusa(tmp_path / "zero3" / "drafter", verifier)
    assert heads.shared_lm_head and torch.equal(heads.shared_head, verifier.lm_head.weight)
