"""Self-distillation data: the verifier rewrites the assistant turns (or continues the code) of a source.

    draftheads regenerate --verifier tiny-code --source stdlib --out regen.jsonl --num-rows 200
    draftheads regenerate --verifier ./Meta-Llama-3-8B-Instruct --source sharegpt.json --out regen.jsonl \\
        --max-new-tokens 512 --batch-size 32 --temperature 0.7
    draftheads regenerate --backend vllm --tensor-parallel-size 4 --verifier ./Llama-3.3-70B-Instruct \\
        --source sharegpt.json --out regen.jsonl --max-new-tokens 1024 --batch-size 1024
    draftheads regenerate --backend vllm --source sharegpt.json --out regen.jsonl --capture cache/regen \
        --config configs/llama3-8b-eagle3.yaml --data.source=regen.jsonl   # + the training rows' hidden states

A drafter learns to predict the verifier, so it learns best from the verifier's own outputs rather than from text
someone else wrote (the self-distillation of Medusa-2 and EAGLE). Chat rows: the verifier answers each user turn
given the conversation so far (system and user messages from the data, its own earlier answers), turn by turn,
batched across conversations with left padding. Text rows: the first --prefix-tokens tokens of each document,
continued by the verifier. The output is JSONL in OpenAI `messages` shape (or `text`), so it reads back as a source:
`--data.source=regen.jsonl`.

Two backends write the same rows: `hf` (Hugging Face `generate` in this process, static batches with left padding;
the default and the reference) and `vllm` (vLLM's offline LLM in its own environment, eval/interop/vllm_data.py:
each batch of --batch-size rows is handed to vLLM at once and batched continuously, with --tensor-parallel-size
devices). Both stop an answer at the same stop tokens and decode it with the same tokenizer here; at temperature 0
they differ only where the two computations round a near-tie differently. With --capture DIR --config TRAIN.yaml
(vllm), the same engine then captures the verifier's hidden states of the training rows built from --out into a
feature cache in DIR, which `--features=offline --feature_cache=DIR` reads (train/regenerate_capture.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from contextlib import ExitStack
from collections.abc import Iterable, Iterator
from pathlib import Path

import datasets
import torch

from draftheads.data.chat import end_of_turn_ids, render_chat, resolve_chat_template
from draftheads.data.config import DataError
from draftheads.data.hidden_states import FEATURE_DTYPES
from draftheads.data.progress import EtaBar, quiet
from draftheads.data.sources import load_source
from draftheads.models.atomic import atomic_path
from draftheads.models.verifier import VerifierError, resolve_verifier
from draftheads.train.vllm_backend import VllmGenerator


def _context_limit(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], stop_ids: list[int], pad_id: int, max_new_tokens: int,
                   temperature: float) -> list[list[int]]:
    """New tokens for each prompt (left-padded into one batch), cut before the first stop token. A VllmGenerator
    `model` hands the prompts to vLLM instead (no padding: it batches them continuously)."""
    from transformers import GenerationConfig

    if isinstance(model, VllmGenerator):
        return cut_at_stop(model.generate_ids(prompts, stop_ids, max_new_tokens, temperature), stop_ids)
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros_like(input_ids)
    for b, ids in enumerate(prompts):
        input_ids[b, longest - len(ids):] = torch.tensor(ids)
        attention_mask[b, longest - len(ids):] = 1
    sampling = temperature > 0
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sampling, pad_token_id=pad_id,
                              eos_token_id=stop_ids or None,
                              **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if sampling else {}))
    device = next(model.parameters()).device
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         generation_config=config)
    return cut_at_stop(out[:, longest:].tolist(), stop_ids)  # (B, new tokens); one host transfer per batch


def cut_at_stop(rows: list[list[int]], stop_ids: list[int]) -> list[list[int]]:
    """Each row up to (without) its first stop token."""
    stops = set(stop_ids)
    return [next((row[:i] for i, t in enumerate(row) if t in stops), row) for row in rows]


def _chat_batch(model, tokenizer, conversations: list[list[dict]], template: str, stop_ids: list[int],
                pad_id: int, max_new_tokens: int, temperature: float, skipped: Counter) -> list[list[dict] | None]:
    """Regenerate the assistant turns of a batch of conversations, one user turn at a time across the batch."""
    # Each conversation as steps: the system/user messages to add before each answer (the data's answers dropped).
    steps: list[list[list[dict]]] = []
    for messages in conversations:
        conv_steps, pending = [], []
        for m in messages:
            if m["role"] == "assistant":
                continue
            pending.append(m)
            if m["role"] == "user":
                conv_steps.append(pending)
                pending = []
        steps.append(conv_steps)
    history: list[list[dict]] = [[] for _ in conversations]
    done = [False] * len(conversations)
    limit = _context_limit(model)
    for turn in range(max((len(s) for s in steps), default=0)):
        active, prompts = [], []
        for c, conv_steps in enumerate(steps):
            if done[c] or turn >= len(conv_steps):
                continue
            ids = tokenizer(render_chat(history[c] + conv_steps[turn], tokenizer, template,
                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            if limit is not None and len(ids) + max_new_tokens > limit:
                done[c] = True
                skipped["context full (conversation cut short)"] += 1
                continue
            active.append(c)
            prompts.append(ids)
        if not active:
            break
        replies = generate_batch(model, prompts, stop_ids, pad_id, max_new_tokens, temperature)
        for c, reply_ids in zip(active, replies):
            reply = tokenizer.decode(reply_ids, skip_special_tokens=True)
            if not reply.strip():  # an empty turn would be a malformed row; stop this conversation here
                done[c] = True
                skipped["empty answer (conversation cut short)"] += 1
                continue
            history[c] += steps[c][turn] + [{"role": "assistant", "content": reply}]
    return [h if any(m["role"] == "assistant" for m in h) else None for h in history]


def regenerate(model, tokenizer, rows: datasets.Dataset | Iterable[dict], *, max_new_tokens: int = 256,
               batch_size: int = 8, temperature: float = 0.0, prefix_tokens: int = 128,
               chat_template: str | None = None, seed: int = 0, progress: bool = True,
               stats: Counter | None = None) -> Iterator[dict]:
    """Yield {"messages": [...]} (chat rows) or {"text": ...} (text rows) written by the model: a Hugging Face
    causal LM, or a `train.vllm_backend.VllmGenerator` (vLLM generates).

    Conversations without a user turn, or whose first answer does not fit the model's context, are skipped and
    counted in `stats` (a Counter, if given).
    """
    rows = list(rows)
    if not rows:
        return
    stats = stats if stats is not None else Counter()
    chat = "messages" in rows[0]
    template = resolve_chat_template(tokenizer, chat_template, where="the source", option_name="--chat-template") \
        if chat else None
    stop_ids = end_of_turn_ids(tokenizer, template) if chat else \
        [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    limit = _context_limit(model)
    keep = prefix_tokens if limit is None else min(prefix_tokens, limit - max_new_tokens)
    if not chat and keep < 1:
        raise DataError(f"max_new_tokens={max_new_tokens} leaves no room for a prefix in the model's context "
                        f"of {limit} tokens; lower --max-new-tokens")
    torch.manual_seed(seed)
    bar = EtaBar(total=len(rows), desc="regenerating", unit="row", disable=quiet() or not progress)
    for start in range(0, len(rows), batch_size):
        batch = rows[start: start + batch_size]
        if chat:
            results = _chat_batch(model, tokenizer, [r["messages"] for r in batch], template, stop_ids, pad_id,
                                  max_new_tokens, temperature, stats)
            for messages in results:
                if messages is None:
                    stats["skipped: no answer generated"] += 1
                else:
                    yield {"messages": messages}
        else:
            prefixes = [tokenizer(r["text"])["input_ids"][:keep] for r in batch]
            continuations = generate_batch(model, prefixes, stop_ids, pad_id, max_new_tokens, temperature)
            for prefix, new in zip(prefixes, continuations):
                yield {"text": tokenizer.decode(prefix, skip_special_tokens=True)
                       + tokenizer.decode(new, skip_special_tokens=True)}
        bar.update(len(batch))
    bar.close()


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    """Write rows as JSON Lines atomically (renamed into place at the end); returns the count."""
    n = 0
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def check_model_folder(folder: str | Path) -> Path:
    """A local HF model folder with a config and safetensors weights (pickle checkpoints are not loaded)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise DataError(f"--verifier {str(folder)!r}: no config.json; expected a Hugging Face model folder")
    if not list(folder.glob("*.safetensors")):
        raise DataError(f"--verifier {str(folder)!r}: no .safetensors weights (pickle checkpoints are not loaded)")
    return folder


def check_writable(path: str | Path) -> None:
    """Raise OSError (or DataError for a folder) unless a file can be written at `path`: its folder is made, and
    a probe file created and removed in it."""
    import tempfile

    path = Path(path)
    if path.is_dir():
        raise DataError(f"--out {str(path)!r} is a folder; expected a .jsonl file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
        pass


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def auto_dtype(dtype: str, device: str) -> str:
    """--dtype auto: bf16 on a GPU, fp32 on the CPU."""
    return ("bfloat16" if device.startswith("cuda") else "float32") if dtype == "auto" else dtype


def load_for_generation(folder: str | Path, dtype: str = "auto", device: str | None = None):
    """(model, tokenizer) from a local HF model folder; safetensors weights only, no remote code."""
    from transformers import AutoModelForCausalLM

    folder = check_model_folder(folder)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, auto_dtype(dtype, device)),
                                                 use_safetensors=True)
    return model.to(device).eval(), load_tokenizer(folder)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftheads regenerate", description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", help="model folder, embedded name (tiny-code) or hub id (with --config: the "
                                      "config's verifier, which this overrides)")
    p.add_argument("--source", required=True, help="a data source (see data.sources): stdlib, FILE, hf:NAME")
    p.add_argument("--out", required=True, help="output .jsonl")
    p.add_argument("--format", default="auto", choices=["auto", "text", "sharegpt", "openai"])
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer / continuation")
    p.add_argument("--batch-size", type=int, default=None,
                   help="rows per batch (default 8 with hf; 256 with vllm, which batches them continuously)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--num-rows", type=int, default=None, help="regenerate only the first K source rows")
    p.add_argument("--prefix-tokens", type=int, default=128, help="text rows: tokens kept as the prompt")
    p.add_argument("--chat-template", default=None, help="chatml, llama3, a .jinja file or template text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="hf backend: cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                   help="what generates: hf (Hugging Face generate in this process, the reference) or vllm (vLLM's "
                        "offline LLM in .venv-vllm: bash scripts/setup_vllm.sh)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm backend: devices vLLM shards over")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="vllm backend: the context vLLM reserves KV cache for (default: the model's)")
    p.add_argument("--strict", action="store_true", help="malformed source rows are errors")
    p.add_argument("--capture", metavar="DIR", default=None,
                   help="vllm backend: also capture the hidden states of the training rows built from --out into a "
                        "feature cache in DIR, in the same engine (needs --config)")
    p.add_argument("--config", default=None,
                   help="with --capture: the training run's YAML (its data.source must be --out, its verifier_dtype "
                        "--dtype), followed by the trainer's --key=value overrides")
    p.add_argument("--capture-dtype", choices=sorted(FEATURE_DTYPES), default=None,
                   help="with --capture: the feature dtype on disk (default bfloat16)")
    p.add_argument("--rows-per-shard", type=int, default=None,
                   help="with --capture: rows per safetensors shard (default 256)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args, rest = p.parse_known_args(argv)
    if rest and args.config is None:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.capture is None and (args.config, args.capture_dtype, args.rows_per_shard) != (None, None, None):
        p.error("--config, --capture-dtype and --rows-per-shard go with --capture DIR")
    if args.capture is not None:
        if args.backend != "vllm":
            p.error("--capture needs --backend vllm (one vLLM engine answers and captures)")
        if args.config is None:
            p.error("--capture needs --config TRAIN.yaml: the training run the cache is for")
        args.capture_dtype = args.capture_dtype or "bfloat16"
        args.rows_per_shard = 256 if args.rows_per_shard is None else args.rows_per_shard
    elif args.verifier is None:
        p.error("the following arguments are required: --verifier")
    if args.batch_size is None:
        args.batch_size = 256 if args.backend == "vllm" else 8
    if args.backend == "vllm" and args.device is not None:
        p.error("--device is the hf backend's; vLLM places the verifier itself (--tensor-parallel-size)")
    if args.backend == "hf" and (args.tensor_parallel_size != 1 or args.max_model_len is not None):
        p.error("--tensor-parallel-size and --max-model-len are the vllm backend's (--backend vllm)")
    for key in ("max_new_tokens", "batch_size", "prefix_tokens", "tensor_parallel_size", "max_model_len",
                "rows_per_shard"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be positive")
    if args.capture is not None:
        return _capture(args, rest)
    folder = Path(args.verifier).expanduser()
    if not folder.is_dir():
        # Embedded names (tiny-code, built on first use) and hub ids resolve through the verifier wrapper
        try:
            folder = resolve_verifier(args.verifier)
        except VerifierError as e:
            sys.exit(f"error: --verifier: {e}")
    from draftheads.eval.interop.vllm_data import VllmError
    from draftheads.eval.interop.vllm_peer import VllmUnavailable

    try:
        check_writable(args.out)  # before a model is loaded or vLLM started
        rows = load_source(args.source, args.format, args.strict)
        if args.num_rows is not None:
            rows = rows.select(range(min(args.num_rows, len(rows))))
        with ExitStack() as stack:
            if args.backend == "vllm":
                check_model_folder(folder)
                tokenizer = load_tokenizer(folder)
                device = "cuda" if torch.cuda.is_available() else "cpu"
                model = stack.enter_context(VllmGenerator.start(folder, auto_dtype(args.dtype, device),
                                                                args.tensor_parallel_size, args.seed,
                                                                args.max_model_len))
            else:
                model, tokenizer = load_for_generation(folder, args.dtype, args.device)
            stats: Counter = Counter()
            written = write_jsonl(args.out, regenerate(
                model, tokenizer, rows, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                temperature=args.temperature, prefix_tokens=args.prefix_tokens, chat_template=args.chat_template,
                seed=args.seed, stats=stats))
    except (DataError, VllmError, VllmUnavailable) as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # a full disk, a folder that cannot be written
        sys.exit(f"error: --out {args.out}: cannot write ({e.strerror or e}{f': {e.filename}' if e.filename else ''})")
    notes = skip_notes(stats)
    print(f"wrote {written} rows to {args.out}" + (f" ({notes})" if notes else ""))


def skip_notes(stats: dict) -> str:
    """The skipped source rows counted by kind, as the closing line says them ('' when none were)."""
    return "; ".join(f"{n} {what}" for what, n in stats.items())


def _capture(args, rest: list[str]) -> None:
    """`--capture DIR --config TRAIN.yaml`: train/regenerate_capture.py, its errors in one line."""
    from draftheads.data.hidden_states import CacheError
    from draftheads.eval.interop.vllm_data import VllmError
    from draftheads.eval.interop.vllm_peer import VllmUnavailable
    from draftheads.models.outputs import OutputInTheWay
    from draftheads.train.cli import user_errors
    from draftheads.train.config import ConfigError, parse_config
    from draftheads.train.dump_features import config_class
    from draftheads.train.regenerate_capture import run

    # --verifier is the trainer's key too: given, it overrides the YAML's, as in `draftheads train`
    config = ["--config", args.config, *rest, *([f"--verifier={args.verifier}"] if args.verifier else [])]
    try:
        cfg = parse_config(config_class(None, config), config, prog="draftheads regenerate --config")
        folder = check_model_folder(resolve_verifier(cfg.verifier))
        check_writable(args.out)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        tokenizer = load_tokenizer(folder)

        def answer(generator, rows, stats):
            return regenerate(generator, tokenizer, rows, max_new_tokens=args.max_new_tokens, batch_size=len(rows),
                              temperature=args.temperature, prefix_tokens=args.prefix_tokens,
                              chat_template=args.chat_template, seed=args.seed, progress=False, stats=stats)

        result = run(args, cfg, folder, auto_dtype(args.dtype, device), answer)
    except (DataError, CacheError, ConfigError, OutputInTheWay, VllmError, VllmUnavailable, *user_errors()) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(f"stopped by SIGINT (Ctrl-C): what was answered and captured is kept in {args.capture}; rerunning "
                 "the same command continues")
    except OSError as e:
        sys.exit(f"error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}; what was answered and captured "
                 f"is kept in {args.capture}, and rerunning the same command continues")
    notes = skip_notes(result.skipped)
    served = (f"; vLLM's prefix cache served {result.cached_tokens / result.captured_tokens:.0%} of the captured "
              "tokens" if result.captured_tokens else "")
    print(f"wrote {result.rows} rows to {args.out}" + (f" ({notes})" if notes else "")
          + f" and their features to {args.capture} ({len(result.shards_written)} shards captured, "
          f"{len(result.shards_skipped)} already done{served})")


if __name__ == "__main__":
    main()
