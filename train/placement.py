"""Where the frozen verifier lives during a run, and how whole weights come back for export.

    verifier, tokenizer = load_verifier(cfg, accelerator.device, accelerator)   # whole, FSDP-sharded, or head-only
    whole = whole_verifier(cfg, verifier, accelerator)                          # with its layers, when a check runs it
    full = unsharded(accelerator, model, build)                                 # whole weights for export and checks

The one place where placement depends on the launch backend: under FSDP (fsdp_version 2) the verifier's decoder
layers are sharded over the processes (`shard_verifier`), and a sharded drafter is gathered (`unsharded`) for the
export, scoring outside `forward` and the train/serve check. Everything else sees a `Verifier` and a module.
"""

from __future__ import annotations

from typing import Callable

import torch

from draftheads.models.dtypes import to_dtype
from draftheads.train.config import ConfigError, RunConfig


def load_verifier(cfg: RunConfig, device, accelerator=None, head_only: bool = False):
    """The frozen verifier and its tokenizer, checked against each other.

    With `accelerator` (a training run, whose folder `build_accelerator` claimed) the run's inputs are recorded and
    checked first (train/run_folder.py `claim_run_inputs`: the verifier's, the data's and the feature cache's
    contents, and the checkpoint it would continue from), and the verifier is placed for the launch config
    (`shard_verifier`): under FSDP it is read on the CPU and its decoder layers are sharded onto `device` one at a
    time, so no device ever holds all of it.

    A training run on cached features (`features: offline`, with `accelerator`) never runs the verifier: it gets
    the verifier head-only (`Verifier.load_head`: the embedding, lm_head and final norm, plus the layers a drafter
    starts its own from, DFlash's `dflash.init_layers`), and `whole_verifier` loads the rest only for what runs it
    (the train/serve check at the end). Its head was checked when the cache was dumped (`draftheads dump-features`
    loads the verifier here without an accelerator, whole, unless vLLM computes the features: `head_only`, the
    same head a run on cached features holds, with the final norm the vLLM backend applies to the last layer).
    """
    from transformers import AutoTokenizer

    from draftheads.models.verifier import Verifier, VerifierError

    if accelerator is not None:
        from draftheads.train.run_folder import claim_run_inputs

        claim_run_inputs(accelerator, cfg)

    if head_only or (accelerator is not None and cfg.features == "offline"):
        layers = getattr(getattr(cfg, "dflash", None), "init_layers", None) or ()  # copied into the drafter
        verifier = Verifier.load_head(cfg.verifier, dtype=cfg.verifier_dtype, device=device,
                                      trust_remote_code=cfg.trust_remote_code, layers=sorted(set(layers)),
                                      embedding_device=embedding_device(cfg, device))
    else:
        verifier = _whole(cfg, device, accelerator)
    check_tokenizer_files(verifier.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(verifier.path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise VerifierError(f"verifier folder {str(verifier.path)!r}: cannot load its tokenizer ({err})") from None
    if len(tokenizer) < 2:
        raise VerifierError(f"verifier folder {str(verifier.path)!r}: its tokenizer has {len(tokenizer)} token(s); "
                            "the tokenizer files are incomplete (copy them from the model's repository)")
    context = getattr(verifier.config, "max_position_embeddings", None)
    if context and cfg.data.seq_len > context:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is longer than the verifier's context ({str(verifier.path)!r}: "
            f"max_position_embeddings={context}); set data.seq_len <= {context}")
    if len(tokenizer) > verifier.vocab_size:
        raise VerifierError(
            f"tokenizer of {str(verifier.path)!r} has {len(tokenizer)} tokens but the verifier's vocab_size is "
            f"{verifier.vocab_size}; the tokenizer does not belong to this model")
    return verifier, tokenizer


def embedding_device(cfg: RunConfig, device) -> str | None:
    """Where a head-only verifier's token embedding is read (`cfg.verifier_embedding`): "cpu" to keep it in host
    memory, None for beside lm_head on `device`."""
    on_accelerator = torch.device(device).type != "cpu"
    if cfg.verifier_embedding == "host" or (cfg.verifier_embedding == "auto" and on_accelerator):
        return "cpu"
    return None


def _whole(cfg: RunConfig, device, accelerator=None):
    """The verifier with its layers, placed for the launch config (FSDP: sharded over the processes)."""
    from draftheads.models.verifier import Verifier

    shard = accelerator is not None and verifier_sharded_by(accelerator)
    verifier = Verifier.from_pretrained(cfg.verifier, dtype=cfg.verifier_dtype, device="cpu" if shard else device,
                                        trust_remote_code=cfg.trust_remote_code)
    if shard:
        shard_verifier(verifier, accelerator, device)
    else:  # Medusa and EAGLE read logits as lm_head(final hidden state); a soft-capped head is refused here
        verifier.check_head("training a drafter on its features")
    return verifier


def whole_verifier(cfg: RunConfig, verifier, accelerator):
    """`verifier` itself when it holds its layers; for a head-only one (`load_verifier` under features: offline)
    the whole verifier, loaded now and placed as `load_verifier` places it (under FSDP sharded: then collective,
    every process calls it). The caller drops it when done, so the layers are held only while something runs
    them. Refuses a verifier whose files changed since the run loaded its head (another fingerprint)."""
    from draftheads.models.verifier import VerifierError

    if not verifier.head_only:
        return verifier
    whole = _whole(cfg, accelerator.device, accelerator)
    if whole.fingerprint != verifier.fingerprint:
        raise VerifierError(f"verifier {verifier.name!r} changed during the run (fingerprint {verifier.fingerprint} "
                            f"when training started, {whole.fingerprint} now); train again on one verifier")
    return whole


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt", "tiktoken.model")


def check_tokenizer_files(folder) -> None:
    """A verifier folder must carry its tokenizer: without one, transformers can build a one-token tokenizer from
    tokenizer_config.json alone, and a run would train on nothing and exit 0."""
    from pathlib import Path

    from draftheads.models.verifier import VerifierError

    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise VerifierError(f"verifier folder {str(folder)!r} has no tokenizer files (expected one of "
                            f"{', '.join(TOKENIZER_FILES)}); copy the tokenizer from the model's repository")


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether some parameter of `module` is an FSDP2 shard (a DTensor): its local tensors are not the weights."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def verifier_sharded_by(accelerator) -> bool:
    """Whether the launch config shards the frozen verifier: FSDP with more than one process."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes > 1


def shard_verifier(verifier, accelerator, device=None) -> bool:
    """Under an FSDP launch config, shard the frozen verifier's decoder layers over the processes
    (`fully_shard_verifier`) onto `device` (default: accelerator.device); under any other backend leave it as it
    is. Returns whether it sharded. The one place where the verifier's placement depends on the backend."""
    if not verifier_sharded_by(accelerator):
        return False
    if not accelerator.is_fsdp2:  # FSDP1 would gather the drafter on rank 0 only; the check needs it everywhere
        raise ConfigError("the FSDP launch config sets fsdp_version: 1; draftheads needs fsdp_version: 2 "
                          "(configs/accelerate/fsdp.yaml)")
    fully_shard_verifier(verifier, device=torch.device(device or accelerator.device))
    return True


def fully_shard_verifier(verifier, mesh=None, device: torch.device | None = None) -> None:
    """Shard each decoder layer of a frozen verifier over the default process group with FSDP2 (`fully_shard`).

    A layer's weights are all-gathered just before its forward and freed after it (reshard_after_forward), so a
    process holds 1/N of the decoder stack plus one layer at a time. The token embedding, the final norm and
    lm_head stay whole on every process: drafters read them directly (`verifier.lm_head.weight`, EAGLE's held
    embedding, Medusa's head initialisation) and they are small next to the layers. The decoder gets a root
    `fully_shard` that manages no parameters (all of its own are ignored), so that the layers are not roots (FSDP2
    keeps a root's weights gathered after forward). Collective: every process calls it, with the same verifier.
    Forward hooks on the layers (`Verifier.features`' layer inputs) see the layer inputs as before.

    A verifier on the CPU with `device` a GPU: each layer is moved to the device as it is sharded (one whole layer
    there at a time), then the unsharded rest (embedding, norm, lm_head, buffers) follows.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    device = torch.device(device) if device is not None else verifier.device
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in verifier.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    whole = {p for name, p in verifier.decoder.named_parameters() if not name.startswith("layers.")}
    fully_shard(verifier.decoder, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
    with torch.no_grad():
        for tensor in [*verifier.model.parameters(), *verifier.model.buffers()]:
            if not isinstance(tensor, DTensor) and tensor.device != device:
                tensor.data = tensor.to(device)  # in place: tied embedding / lm_head stay one tensor


def sharded_weights(accelerator) -> bool:
    """Whether the launch config shards the weights of what `accelerator.prepare` wraps (FSDP, DeepSpeed ZeRO-3)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    return (accelerator.distributed_type == DistributedType.DEEPSPEED
            and accelerator.deepspeed_config["zero_optimization"]["stage"] == 3)


def unsharded(accelerator, model: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
    """The trained module with whole weights, for export, scoring outside `forward` and the train/serve check.

    Under DDP, ZeRO-1/2 or one process that is `accelerator.unwrap_model(model)` itself. When the weights are
    sharded (FSDP, DeepSpeed ZeRO-3) the full state dict is gathered (collective: every process calls this) and
    loaded into a fresh unsharded copy made by `build()` (same class and shapes as the unwrapped module): under
    FSDP on every process (the verifier may be sharded too, so the check runs everywhere), under ZeRO-3 on the
    main process only (None elsewhere; DeepSpeed gathers to rank 0).
    """
    inner = accelerator.unwrap_model(model)
    if is_sharded(inner):  # FSDP2 (accelerate's fsdp_version: 2): DTensor parameters
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    elif sharded_weights(accelerator):
        state = accelerator.get_state_dict(model)  # FSDP1 / ZeRO-3: the full tensors on the main process
        if not accelerator.is_main_process:
            return None
    else:
        return inner
    copy = build().to(accelerator.device)
    copy.load_state_dict({k: v.to(accelerator.device) for k, v in state.items()})
    return copy.train(inner.training)


def export_drafter(accelerator, model: torch.nn.Module, dtype: str, build: Callable[[], torch.nn.Module]):
    """The trained `.drafter` of `model` (a train module) with whole weights (`unsharded`; `build` makes a fresh train
    module like the trained one), cast to the export `dtype`; None where `unsharded` gives none. Training is over."""
    full = unsharded(accelerator, model, build)
    return full.drafter.to(to_dtype(dtype)) if full is not None else None
