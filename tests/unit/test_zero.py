"""train/zero.py: a DeepSpeed launch that would not train what the run config says is refused in one line naming the
key and the file; `auto` keys are filled from the run config. The real launches are tests/e2e/test_deepspeed.py."""

import sys
from types import SimpleNamespace

import pytest
import torch

from draftheads.train.config import ConfigError, RunConfig
from draftheads.train.zero import before_accelerator, config_file_flag, settle_deepspeed


def fake_accelerator(config: dict, stage: int = 2, zero3_init: bool = False, distributed=None, processes: int = 2):
    from accelerate.utils import DistributedType

    config = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "none"},
                                    "offload_param": {"device": "none"},
                                    "stage3_gather_16bit_weights_on_model_save": stage == 3},
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
              "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": False}, "fp16": {"enabled": False},
              **config}
    plugin = SimpleNamespace(deepspeed_config=config, zero3_init_flag=zero3_init)
    return SimpleNamespace(distributed_type=distributed or DistributedType.DEEPSPEED, num_processes=processes,
                           state=SimpleNamespace(deepspeed_plugin=plugin))


@pytest.fixture
def deepspeed_launch(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr("draftheads.train.zero.launch_config", lambda: "z.yaml")


def refused(accelerator, cfg=None) -> str:
    with pytest.raises(ConfigError) as err:
        settle_deepspeed(accelerator, cfg or RunConfig())
    assert "\n" not in str(err.value)
    return str(err.value)


def test_nothing_happens_without_deepspeed(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    settle_deepspeed(fake_accelerator({"gradient_clipping": 7.0}), RunConfig())
    assert before_accelerator() == []


def test_auto_keys_are_filled_from_the_run_config(deepspeed_launch):
    cfg = RunConfig()
    cfg.train.grad_clip, cfg.train.batch_size, cfg.train.grad_accum = 0.5, 3, 2
    accelerator = fake_accelerator({})
    settle_deepspeed(accelerator, cfg)
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    assert config["gradient_clipping"] == 0.5  # Accelerate would have filled 1.0
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["train_batch_size"] == 3 * 2 * 2
    absent = fake_accelerator({})
    del absent.state.deepspeed_plugin.deepspeed_config["gradient_clipping"]  # absent: DeepSpeed would not clip
    settle_deepspeed(absent, cfg)
    assert absent.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] == 0.5


def test_ddp_standing_in_is_refused(deepspeed_launch, monkeypatch):
    from accelerate.utils import DistributedType

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    message = refused(fake_accelerator({}, distributed=DistributedType.MULTI_CPU))
    assert message.startswith("z.yaml asks for DeepSpeed but Accelerate set up") and "ACCELERATE_USE_CPU" in message


@pytest.mark.parametrize("config, cfg_change, expected", [
    ({"gradient_accumulation_steps": 4}, {}, "z.yaml: deepspeed_config.gradient_accumulation_steps=4 but "
                                             "train.grad_accum=1"),
    ({"gradient_clipping": 1.0}, {"grad_clip": 0.5}, "z.yaml: deepspeed_config.gradient_clipping=1.0 but "
                                                     "train.grad_clip=0.5"),
    ({}, {"optimizer": "muon"}, "train.optimizer=muon under DeepSpeed (z.yaml)"),
    ({"bf16": {"enabled": True}}, {}, "z.yaml: bf16.enabled=True but train.mixed_precision=no"),
    ({}, {"mixed_precision": "bf16"}, "z.yaml: bf16.enabled=False but train.mixed_precision=bf16"),
    ({"train_micro_batch_size_per_gpu": 4}, {}, "z.yaml: train_micro_batch_size_per_gpu=4 but the run trains 8"),
    ({"optimizer": {"type": "AdamW"}}, {}, "z.yaml: optimizer: draftheads trains with its own optimizer"),
], ids=["accum", "clip", "muon", "bf16-on", "bf16-off", "micro-batch", "optimizer-section"])
def test_what_deepspeed_would_do_otherwise_is_refused(deepspeed_launch, config, cfg_change, expected):
    cfg = RunConfig()
    for key, value in cfg_change.items():
        setattr(cfg.train, key, value)
    assert refused(fake_accelerator(config), cfg).startswith(expected)


def test_a_deepspeed_json_is_named_with_its_own_keys(deepspeed_launch, monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds.json")
    message = refused(fake_accelerator({"gradient_clipping": 2.0}))
    assert message.startswith("ds.json: gradient_clipping=2.0 but train.grad_clip=1.0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="offloading is refused only without a GPU")
def test_offload_without_a_gpu_is_refused(deepspeed_launch):
    accelerator = fake_accelerator({})
    accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    assert refused(accelerator).startswith("z.yaml: deepspeed_config.offload_optimizer_device=cpu on a machine "
                                           "without a GPU")


def test_zero3_needs_whole_weights_gathered_and_no_zero_init(deepspeed_launch):
    assert "deepspeed_config.zero3_init_flag=true" in refused(fake_accelerator({}, stage=3, zero3_init=True))
    accelerator = fake_accelerator({}, stage=3)
    accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"][
        "stage3_gather_16bit_weights_on_model_save"] = False
    assert refused(accelerator).startswith("z.yaml: deepspeed_config.zero3_save_16bit_model=false")
    settle_deepspeed(fake_accelerator({}, stage=3), RunConfig())  # the shipped ZeRO-3 settings pass


def test_deepspeed_not_installed_is_one_line(deepspeed_launch, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed now raises ImportError
    monkeypatch.setitem(sys.modules, "deepspeed.ops", None)
    with pytest.raises(ConfigError, match=r"z.yaml asks for DeepSpeed .* pip install 'draftheads\[deepspeed\]'"):
        before_accelerator()


def test_the_config_file_is_read_from_the_launch_command():
    assert config_file_flag(["python", "accelerate", "launch", "--config_file", "a.yaml", "train/eagle.py"]) == "a.yaml"
    assert config_file_flag(["accelerate", "launch", "--config-file=b.yaml", "x.py"]) == "b.yaml"
    assert config_file_flag(["accelerate", "launch", "x.py", "--config", "run.yaml"]) is None


def test_the_weights_guard_reads_a_zero3_partition():
    """Under ZeRO-3 a parameter is an empty placeholder outside forward; its values live in `ds_tensor`."""
    from draftheads.train.loop import all_finite

    placeholder = torch.nn.Parameter(torch.empty(0))
    placeholder.ds_tensor = torch.tensor([1.0, float("nan")])
    assert not bool(all_finite([placeholder]))
    placeholder.ds_tensor = torch.tensor([1.0, 2.0])
    assert bool(all_finite([placeholder, torch.nn.Parameter(torch.ones(2))]))
