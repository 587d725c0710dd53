"""The frozen verifier: any Hugging Face causal LM, with the handles drafters train on.

A drafter never owns the verifier; it reads from it:
  - `embed_tokens`   the token embedding (EAGLE feeds embed(x_{t+1}))
  - `final_features` the last post-norm hidden state h_t, the input of lm_head (Medusa, EAGLE-1)
  - `layer_features` the inputs of chosen decoder layers, i.e. HF `hidden_states[i]` (EAGLE-3 takes three)
  - `lm_head`        the output projection (shared by EAGLE-1, initialises Medusa heads)
  - `fingerprint`    a short hash that a drafter stores so it is never paired with another verifier

`Verifier.load_head(...)` loads what training on cached features reads and nothing more: the model is built on
the meta device and only the embedding, lm_head and final norm (plus any decoder layers asked for) are read from
the safetensors files, by name. At Llama-3.1-8B's shapes in bf16 that is 2 x 128256 x 4096 x 2 bytes = 1.96 GiB
instead of 15 GiB. Its fingerprint is computed from the files, as `from_pretrained`'s, so it is the same value;
what would run the layers (`features`, `check_head`, `forward`) refuses in one line.

Weights load only from safetensors; `trust_remote_code` is off unless asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftheads.models.placed import Placed

#: Names that resolve to the embedded default verifiers built by `draftheads build-verifier`.
EMBEDDED_VERIFIERS = {"tiny-code": "default", "tiny-micro": "micro"}

#: Config fields that must agree between a drafter and its verifier (besides the fingerprint).
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size")


class VerifierError(ValueError):
    """A verifier that cannot be loaded or does not fit; the message says what to fix."""


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "auto": None}
    if dtype not in names:
        raise VerifierError(f"unknown dtype {dtype!r}; expected one of {sorted(names)}")
    return names[dtype]


def resolve_verifier(name_or_path: str | os.PathLike) -> Path:
    """Turn a verifier name into a local folder holding config.json and safetensors weights.

    Order: an embedded default name (`tiny-code`, `tiny-micro`; built on first use), an existing local folder,
    then a Hugging Face hub id (downloaded once; only json, tokenizer and safetensors files are fetched).
    """
    name = str(name_or_path)
    if name in EMBEDDED_VERIFIERS:
        from draftheads.models import tiny  # built lazily: most callers never need it

        return Path(tiny.ensure_built(EMBEDDED_VERIFIERS[name]))
    problem = verifier_problem(name)
    if problem:
        raise VerifierError(problem)
    path = Path(name).expanduser()
    folder = path if path.is_dir() else _download(name)
    if not (folder / "config.json").is_file():
        raise VerifierError(f"verifier folder {str(folder)!r} has no config.json; expected a Hugging Face model folder")
    if not _safetensors_files(folder):
        found = sorted(p.name for p in folder.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
        hint = f" (found {', '.join(found)})" if found else ""
        raise VerifierError(
            f"verifier folder {str(folder)!r} has no .safetensors weights{hint}; draftheads loads weights only from "
            "safetensors, never pickle. Convert once with `model.save_pretrained(dir, safe_serialization=True)` "
            "in a trusted environment."
        )
    return folder


def verifier_problem(name: str) -> str | None:
    """What is wrong with a verifier name before anything is read or fetched (one line naming `verifier`), or None:
    it must be an embedded name, an existing folder, or a well-formed hub id (`org/name`); a path that does not
    exist, a file, or a name the hub cannot hold is refused. Whether a folder holds a model is checked on loading."""
    if name in EMBEDDED_VERIFIERS:
        return None
    if not name.strip():  # before the folder test: Path("") is the working folder
        return (f"verifier {name!r}: expected a model folder, a hub id (`org/name`) or an embedded name "
                f"({', '.join(EMBEDDED_VERIFIERS)})")
    path = Path(name).expanduser()
    if path.is_dir():
        return None
    if path.exists():
        return f"verifier {name!r} is a file; expected a model folder with config.json"
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return f"verifier folder {name!r} does not exist"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return (f"verifier {name!r}: not a folder here, nor a Hugging Face hub id (`org/name`: letters, digits, "
                f"'-', '_' and '.'), nor an embedded name ({', '.join(EMBEDDED_VERIFIERS)})")
    return None


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"],
        ))
    except Exception as err:  # offline, gated, misspelt: all end the same way for the user
        raise VerifierError(
            f"verifier {repo_id!r} is not a local folder, and it could not be fetched from the Hugging Face hub "
            f"({type(err).__name__}: {err}). Pass a local model folder or an embedded name "
            f"({', '.join(EMBEDDED_VERIFIERS)})."
        ) from None


#: What a verifier folder is made of: the files transformers reads (weights, config, tokenizer, chat template), the
#: patterns the hub download fetches. `draftheads_build.json` (the embedded verifier's build log) is not read.
CONTENT_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".tiktoken", ".jinja")


def content_files(folder: str | os.PathLike) -> list[str]:
    """Names of the files a verifier folder is made of (see CONTENT_SUFFIXES), sorted."""
    return sorted(p.name for p in Path(folder).iterdir() if p.is_file() and p.suffix in CONTENT_SUFFIXES
                  and not p.name.startswith((".", "draftheads")))


def folder_content(folder: str | os.PathLike, known: dict | None = None) -> dict:
    """{"digest", "files"}: a verifier folder by content (data/identity.py); `known` (an earlier record's "files")
    skips re-reading files whose size and mtime are unchanged."""
    from draftheads.data.identity import digest, files_record

    files = files_record(folder, content_files(folder), known)
    return {"digest": digest(files), "files": files}


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _unreadable_safetensors(folder: Path) -> tuple[str, str] | None:
    """(file name, reason) of the first .safetensors file whose header or size is broken, else None."""
    from safetensors import safe_open

    for path in _safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as err:  # SafetensorError: truncated file, bad header
            return path.name, str(err)
    return None


def fingerprint_files(folder: Path, config: dict) -> str:
    """Hash of the checkpoint on disk: config shape fields, every tensor's name/dtype/shape and its first values.

    Computed from the stored bytes, so the same checkpoint loaded in fp32, bf16 or fp16 has one fingerprint.
    """
    from safetensors import safe_open

    digest = hashlib.sha256()
    digest.update(json.dumps({k: config.get(k) for k in ("model_type", *SHAPE_FIELDS)}, sort_keys=True).encode())
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for key in sorted(f.keys()):
                sl = f.get_slice(key)
                shape = sl.get_shape()
                digest.update(f"{key}|{sl.get_dtype()}|{shape}".encode())
                head = sl[: min(shape[0], 4)] if shape else f.get_tensor(key)
                digest.update(head.flatten()[:1024].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def fingerprint_module(model: nn.Module) -> str:
    """Fingerprint of an in-memory model that was not loaded from a folder (tests, notebooks)."""
    digest = hashlib.sha256()
    cfg = model.config.to_dict()
    digest.update(json.dumps({k: cfg.get(k) for k in ("model_type", *SHAPE_FIELDS)}, sort_keys=True).encode())
    for key, value in sorted(model.state_dict().items()):
        digest.update(f"{key}|{tuple(value.shape)}".encode())
        digest.update(value.detach().float().flatten()[:1024].cpu().numpy().tobytes())
    return "mem-" + digest.hexdigest()[:12]


def _read_config(folder: Path, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as err:  # transformers raises OSError for a config.json that is not JSON
        raise VerifierError(f"verifier folder {str(folder)!r}: cannot read config.json "
                            f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__})"
                            ) from None


def _folder_fingerprint(folder: Path) -> str:
    with open(folder / "config.json") as f:
        return fingerprint_files(folder, json.load(f))


def _load_modules(model: nn.Module, modules: list[nn.Module], folder: Path, dtype: torch.dtype | None,
                  device: torch.device | None) -> None:
    """Read the parameters of `modules` (submodules of `model`, built on the meta device) from the folder's
    safetensors files by name, in `dtype` (None: as stored), onto `device` (None: the CPU). A tied lm_head stays
    the embedding's tensor. Every other parameter and buffer of `model` stays on the meta device."""
    from safetensors import safe_open

    wanted = {id(p) for m in modules for p in m.parameters()}
    names: dict[int, list[str]] = {}  # one tensor, every name it has (tied embedding and lm_head: two)
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in wanted:
            names.setdefault(id(p), []).append(name)
            params[id(p)] = p
    files = {}  # checkpoint key -> file (a sharded checkpoint spreads them over several)
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), file))
    prefix = getattr(model, "base_model_prefix", "") + "."
    loaded: dict[int, torch.Tensor] = {}
    for key, aliases in names.items():
        candidates = [n for a in aliases for n in (a, a.removeprefix(prefix) if a.startswith(prefix) else None) if n]
        found = next((n for n in candidates if n in files), None)
        if found is None:
            raise VerifierError(f"verifier folder {str(folder)!r}: no tensor {aliases[0]!r} in its safetensors files "
                                f"(looked for {', '.join(dict.fromkeys(candidates))})")
        with safe_open(str(files[found]), framework="pt", device="cpu") as f:
            tensor = f.get_tensor(found)
        expected = tuple(params[key].shape)
        if tuple(tensor.shape) != expected:
            raise VerifierError(f"verifier folder {str(folder)!r}: tensor {found!r} has shape {tuple(tensor.shape)}, "
                                f"its config gives {expected}")
        loaded[key] = tensor.to(dtype=dtype or tensor.dtype, device=device or "cpu")
    owners = {}  # parameter id -> [(module, attribute)] wherever it is registered
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None and id(p) in loaded:
                owners.setdefault(id(p), []).append((module, attr))
    for key, places in owners.items():
        param = nn.Parameter(loaded[key], requires_grad=False)  # one Parameter for every place: ties stay tied
        for module, attr in places:
            module._parameters[attr] = param


@dataclass
class VerifierFeatures:
    """What one verifier forward gives a drafter."""

    final: torch.Tensor
    """(B, T, H) last post-norm hidden state, the input of lm_head."""
    layers: list[torch.Tensor]
    """(B, T, H) each: the inputs of the requested decoder layers, in the order asked."""
    logits: torch.Tensor | None = None
    """(B, T, V) the verifier's logits, when asked for."""
    argmax: torch.Tensor | None = None
    """(B, T) int64 the argmax of lm_head(final) over the whole vocabulary, when a feature cache stored it (EAGLE-3's
    targets then need only the draft vocabulary's rows of lm_head: `Verifier.keep_head_rows`)."""


@contextmanager
def capture_layer_inputs(layers: nn.ModuleList, layer_ids):
    """Within the block, {i: the input of decoder layer i} for each forward (forward pre-hooks; HF hidden_states[i])."""
    captured: dict[int, torch.Tensor] = {}

    def hook_for(i):
        def hook(module, args, kwargs):
            captured[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    handles = [layers[i].register_forward_pre_hook(hook_for(i), with_kwargs=True) for i in sorted(set(layer_ids))]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


class Verifier(Placed, nn.Module):
    """A frozen causal LM. Build with `Verifier.from_pretrained(name_or_path)` or wrap a live model."""

    placed_by = "embed_tokens"
    head_only: bool = False
    """True when only the embedding, lm_head and final norm were loaded (`load_head`): the layers are on the meta
    device and nothing that runs them works."""
    embedding_held_apart: bool = False
    """True when `load_head` read the token embedding onto another device than the rest (host memory beside a
    GPU): read its rows with `models.placed.embedding_rows`."""

    def __init__(self, model: nn.Module, name: str | None = None, fingerprint: str | None = None,
                 path: Path | None = None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.name = name or getattr(model.config, "_name_or_path", "") or model.config.model_type
        self.path = path
        self.fingerprint = fingerprint or fingerprint_module(model)
        decoder = model.get_decoder()
        if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
            raise VerifierError(
                f"verifier {self.name!r} ({type(model).__name__}) has no `layers`/`norm` on its decoder; "
                "draftheads supports Llama-style decoders (Llama, Qwen2, Mistral, ...)"
            )
        self.decoder = decoder
        self._kept_ids: torch.Tensor | None = None  # token ids of `kept_head_rows`, after keep_head_rows

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, dtype: str | torch.dtype | None = None,
                        device: str | torch.device | None = None, trust_remote_code: bool = False,
                        attn_implementation: str | None = None) -> "Verifier":
        from transformers import AutoModelForCausalLM

        folder = resolve_verifier(name_or_path)
        config = _read_config(folder, trust_remote_code)
        kwargs = {"dtype": _dtype(dtype)} if _dtype(dtype) is not None else {}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, config=config, use_safetensors=True, trust_remote_code=trust_remote_code, **kwargs)
        except Exception as err:  # corrupt shard, wrong shapes: say which folder
            damaged = _unreadable_safetensors(folder)
            if damaged:
                raise VerifierError(
                    f"verifier folder {str(folder)!r}: weights file {damaged[0]} is corrupt or incomplete ({damaged[1]}); "
                    "download or copy it again") from None
            raise VerifierError(f"verifier folder {str(folder)!r} failed to load: {type(err).__name__}: {err}") from None
        if device is not None:
            model = model.to(device)
        return cls(model, name=str(name_or_path), fingerprint=_folder_fingerprint(folder), path=folder)

    @classmethod
    def load_head(cls, name_or_path: str | os.PathLike, dtype: str | torch.dtype | None = None,
                  device: str | torch.device | None = None, trust_remote_code: bool = False,
                  layers: list[int] | tuple[int, ...] = (),
                  embedding_device: str | torch.device | None = None) -> "Verifier":
        """The verifier as training on cached features reads it: the token embedding, lm_head and final norm
        (and the decoder layers `layers`, e.g. to start a drafter's layers from) read from the safetensors files,
        the rest of the model on the meta device. Same name, config and fingerprint as `from_pretrained`'s; the
        tensors it holds are equal to that model's (read in `dtype`, default: as stored, on `device`).

        `embedding_device` (e.g. "cpu" while `device` is a GPU): where the token embedding is read to instead, as
        the drafters read only the rows of a step's tokens from it (`models.placed.embedding_rows`); `device` then
        answers where the rest is. Ignored for an embedding tied to lm_head, which the head's products need on
        `device` (`embedding_held_apart` says which)."""
        from transformers import AutoModelForCausalLM

        folder = resolve_verifier(name_or_path)
        config = _read_config(folder, trust_remote_code)
        dtype = _dtype(dtype)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                     **({"dtype": dtype} if dtype is not None else {}))
        verifier = cls(model, name=str(name_or_path), fingerprint=_folder_fingerprint(folder), path=folder)
        verifier.check_layer_ids(list(layers), key="layers")
        device = torch.device(device) if device is not None else None
        apart = (embedding_device is not None and torch.device(embedding_device) != (device or torch.device("cpu"))
                 and verifier.embed_tokens.weight is not verifier.lm_head.weight)
        modules = [verifier.lm_head, verifier.norm, *(verifier.layers[i] for i in layers)]
        if apart:
            _load_modules(model, [verifier.embed_tokens], folder, dtype, torch.device(embedding_device))
        else:
            modules.append(verifier.embed_tokens)
        _load_modules(model, modules, folder, dtype, device)
        verifier.head_only = True
        verifier.embedding_held_apart = apart
        return verifier

    # ---- handles -------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the verifier computes: its embedding's device, or the final norm's where the embedding is held
        apart (`load_head`'s `embedding_device`)."""
        return (self.norm if self.embedding_held_apart else self.embed_tokens).weight.device

    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def norm(self) -> nn.Module:
        return self.decoder.norm

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @torch.no_grad()
    def head_argmax(self, final: torch.Tensor, weight: torch.Tensor | None = None, chunk_bytes: int = 1 << 28
                    ) -> torch.Tensor:
        """(N, T) int32 argmax of lm_head(final) over the whole vocabulary (the first maximum, as EAGLE-3's targets
        take it), for `final` (N, T, H) as a cache stores it, in the head's dtype (the verifier's logits as it
        computes them); computed where `weight` is (default lm_head's own; a copy of it elsewhere), a slice of
        positions at a time (logits of at most `chunk_bytes`), returned on `final`'s device."""
        weight = self.lm_head.weight if weight is None else weight
        device = weight.device
        bias = None if self.lm_head.bias is None else self.lm_head.bias.to(device, weight.dtype)
        N, T, H = final.shape
        flat = final.reshape(N * T, H)
        per = max(1, chunk_bytes // (weight.shape[0] * weight.element_size()))
        out = torch.empty(N * T, dtype=torch.int32)
        for s in range(0, N * T, per):
            x = flat[s:s + per].to(device, weight.dtype)
            out[s:s + per] = F.linear(x, weight, bias).max(-1).indices.to("cpu", torch.int32)
        return out.reshape(N, T).to(final.device)

    def keep_head_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Keep only lm_head's rows `ids` (1-D token ids) and free the rest: returns them as one (len(ids), H) tensor,
        which `lm_head_rows` then answers from. A run on cached features that stored the verifier's argmax reads no
        other row (EAGLE-3: its draft vocabulary's). None, and the head kept whole, where nothing can be freed: a
        head tied to the embedding, or one with a bias (its logits are not these rows' products alone)."""
        weight = self.lm_head.weight
        ids = ids.to(torch.long).flatten()
        if self._kept_ids is not None:
            return self.lm_head_rows(ids)
        if weight.data_ptr() == self.embed_tokens.weight.data_ptr() or self.lm_head.bias is not None:
            return None
        rows = weight.detach()[ids.to(weight.device)].contiguous()
        self._kept_ids = ids.cpu()
        self.register_buffer("kept_head_rows", rows, persistent=False)  # counted where the verifier's tensors are
        self.lm_head.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
        return rows

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), H) the lm_head rows of token ids `ids` (1-D), from the whole head or the rows `keep_head_rows`
        kept (a row it freed is refused in one line)."""
        ids = ids.to(torch.long).flatten()
        if self._kept_ids is None:
            weight = self.lm_head.weight
            return weight.detach()[ids.to(weight.device)]
        kept, rows = self._kept_ids, self.kept_head_rows
        if torch.equal(kept, ids.cpu()):
            return rows
        where = {int(t): i for i, t in enumerate(kept.tolist())}
        missing = [int(t) for t in ids.tolist() if int(t) not in where]
        if missing:
            raise VerifierError(f"verifier {self.name!r} holds {len(kept)} rows of its lm_head (keep_head_rows); "
                                f"token ids {missing[:5]} were freed")
        return rows[torch.tensor([where[int(t)] for t in ids.tolist()], device=rows.device)]

    @property
    def holds_whole_head(self) -> bool:
        """False after `keep_head_rows` freed rows of lm_head: then nothing may compute lm_head(final) itself."""
        return self._kept_ids is None

    def describe(self) -> dict:
        """What a drafter stores about its verifier (and checks on load)."""
        return {"name": self.name, "fingerprint": self.fingerprint,
                **{k: getattr(self.config, k) for k in SHAPE_FIELDS}}

    def content(self, known: dict | None = None) -> dict | None:
        """{"digest", "files"} of the folder the verifier was loaded from (None for a model built in memory); `known`:
        an earlier record's "files", trusted for files whose size and mtime are unchanged."""
        return folder_content(self.path, known) if self.path is not None else None

    def default_eagle3_layers(self) -> list[int]:
        """vLLM's default EAGLE-3 feature layers: the inputs of layers 2, L//2 and L-3. Below 7 layers those repeat
        a layer (4 layers: 2, 2, 1), which the engines cannot serve; such shallow verifiers get three distinct
        layers, early, middle and late: 1, L//2, L-1 (3 layers: 0, 1, 2). Exports write the ids explicitly."""
        n = self.num_layers
        ids = [2, n // 2, n - 3]
        if ids[0] < ids[1] < ids[2]:
            return ids
        if n < 3:
            raise VerifierError(f"verifier {self.name!r} has {n} layers; EAGLE-3 needs three distinct feature layers")
        return [1, n // 2, n - 1] if n > 3 else [0, 1, 2]

    def check_layer_ids(self, layer_ids: list[int], key: str = "layer_ids") -> None:
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise VerifierError(
                f"{key}={list(layer_ids)}: {bad} out of range for verifier {self.name!r} with "
                f"{self.num_layers} layers; expected ids in 0..{self.num_layers - 1} (HF hidden_states[i], "
                "the input of layer i)"
            )

    def check_head(self, what: str = "reading its features") -> None:
        """Refuse a model whose logits are not lm_head(final post-norm hidden state) (a soft-capped or scaled head):
        every feature-based method and the engine's verification compute logits that way. One short forward."""
        self._need_layers(what)
        ids = torch.arange(4, device=self.device)[None] % self.vocab_size
        final = {}

        def keep_final(module, args, out):  # returns None: the decoder's output goes on unchanged
            final["h"] = out.last_hidden_state

        hook = self.decoder.register_forward_hook(keep_final)
        try:
            with torch.no_grad():  # one forward: the decoder's output on the way, the model's logits at the end
                theirs = self.model(input_ids=ids, use_cache=False).logits.float()
                ours = self.lm_head(final["h"]).float()
        finally:
            hook.remove()
        if not torch.isfinite(theirs).all():  # a broken model: nothing to compare (the trainers' guard reports it)
            return
        if not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3 * float(theirs.abs().max()) + 1e-5):
            raise VerifierError(
                f"verifier {self.name!r} (model_type {self.config.model_type!r}): its logits are not "
                f"lm_head(final hidden state) (soft-capped or scaled output head), which {what} needs")

    def check_document_mask(self, what: str = "data.document_mask=true") -> None:
        """Refuse a verifier that attends across document boundaries when given packed rows (position_ids that
        restart at 0, no attention_mask: data/documents.py). transformers builds the block-diagonal causal mask
        from such position_ids for the families whose decoders use its masking utilities (Llama, Qwen2, Mistral,
        Qwen3, Qwen3-MoE, ...) with sdpa, eager, flex or flash attention; a model that does not is caught here by
        one short forward: two documents packed in one row against the second computed alone. Checked once."""
        if getattr(self, "_documents_checked", False):
            return
        self._need_layers(what)
        V = self.vocab_size
        first = (torch.arange(5, device=self.device) * 7 + 3) % V
        second = (torch.arange(6, device=self.device) * 11 + 5) % V
        packed = torch.cat([first, second])[None]  # (1, 11)
        positions = torch.cat([torch.arange(5), torch.arange(6)]).to(self.device)[None]
        with torch.no_grad():
            together = self.features(packed, position_ids=positions).final[0, 5:].float()
            alone = self.features(second[None]).final[0].float()
        if not (torch.isfinite(alone).all() and torch.isfinite(together).all()):
            return  # a broken model: nothing to compare (the trainers' guard reports it); checked again next run
        scale = float(alone.abs().max()) + 1e-6
        tol = 1e-4 if self.dtype == torch.float32 else 3e-2
        if not torch.allclose(together, alone, rtol=tol, atol=tol * scale):
            raise VerifierError(
                f"verifier {self.name!r} (model_type {self.config.model_type!r}, attention "
                f"{getattr(self.config, '_attn_implementation', None)!r}) attends across document boundaries in a "
                f"packed row (a packed document's features differ from the document's alone), which {what} needs; "
                "set attn_implementation to sdpa or eager, or data.document_mask=false")
        self._documents_checked = True

    # ---- forward -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 layer_ids: list[int] | tuple[int, ...] = (), return_logits: bool = False,
                 position_ids: torch.Tensor | None = None) -> VerifierFeatures:
        """One frozen forward; keeps only the requested layers' inputs (hooks, not `output_hidden_states`).

        position_ids (B, T) of packed rows (restarting at 0 per document, data/documents.py) replace the
        attention_mask: transformers then masks attention at the document boundaries (it does so only when no
        attention_mask is given); rows are right-padded, and the padding is a document of its own or the end of
        the row's only one, so no real token attends to it either way."""
        self._need_layers("computing features")
        layer_ids = list(layer_ids)
        self.check_layer_ids(layer_ids)
        if position_ids is not None:
            attention_mask = None
        with capture_layer_inputs(self.layers, layer_ids) as captured:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False)
        final = out.last_hidden_state  # (B, T, H), post-norm
        logits = self.lm_head(final) if return_logits else None
        return VerifierFeatures(final=final, layers=[captured[i] for i in layer_ids], logits=logits)

    def forward(self, *args, **kwargs):
        self._need_layers("a forward")
        return self.model(*args, **kwargs)

    def _need_layers(self, what: str) -> None:
        if self.head_only:
            raise VerifierError(f"verifier {self.name!r} was loaded head-only (embedding, lm_head and final norm: "
                                f"what training on cached features reads); {what} needs its layers: load it with "
                                "Verifier.from_pretrained")

    def held_bytes(self) -> int:
        """Bytes of the weights and buffers this verifier holds in memory (meta tensors hold none; a tied tensor
        counts once; the lm_head rows `keep_head_rows` kept count: a buffer of the verifier itself)."""
        tensors = {id(t): t for t in [*self.parameters(), *self.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values() if t.device.type != "meta")


def check_drafter_matches(stored: dict, verifier: Verifier, drafter_path: str | os.PathLike,
                          check_fingerprint: bool = True) -> None:
    """Refuse a drafter trained for another verifier; the message names the field that differs."""
    mine = verifier.describe()
    for key in SHAPE_FIELDS:
        if key in stored and stored[key] != mine[key]:
            raise VerifierError(
                f"drafter {str(drafter_path)!r} was trained for a verifier with {key}={stored[key]}, but verifier "
                f"{verifier.name!r} has {key}={mine[key]}"
            )
    if not check_fingerprint:
        return
    if stored.get("fingerprint") and stored["fingerprint"] != mine["fingerprint"]:
        raise VerifierError(
            f"drafter {str(drafter_path)!r} was trained for verifier {stored.get('name')!r} (fingerprint "
            f"{stored['fingerprint']}), but verifier {verifier.name!r} has fingerprint {mine['fingerprint']}; "
            "pass the verifier it was trained on (or check_fingerprint=False if you know the weights are the same)"
        )
    check_content(stored.get("files"), verifier, f"drafter {str(drafter_path)!r}", "trained on",
                  "pass the verifier it was trained on, or train the drafter again on this one")


def check_content(stored_files: dict | None, verifier: Verifier, what: str, relation: str, fix: str) -> None:
    """Refuse a verifier whose files differ from those `what` records (`stored_files`, a content record), naming
    the files. Nothing to compare (no record, a verifier built in memory): no check."""
    from draftheads.data.identity import changes, summarize

    if not stored_files or verifier.path is None:
        return
    changed = changes(stored_files, verifier.content(known=stored_files)["files"])
    if changed:
        raise VerifierError(
            f"verifier {verifier.name!r} is not the one {what} was {relation}: {summarize(changed)}; {fix}")
