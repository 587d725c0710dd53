"""Run several decoding methods over one prompt set and time them fairly: what `draftheads eval` and
`scripts/bench_decode.py` measure with.

    specs = [MethodSpec("autoregressive"), MethodSpec("eagle", draft="runs/eagle3-tiny/drafter", options={"chain": 3}),
             MethodSpec("hf-assisted", label="hf-assisted")]
    runs = run_methods(verifier, specs, prompts, RunSettings(max_new_tokens=128))   # list[draftheads.eval.measure.metrics.MethodRun]

Fairness on a shared machine:
  - every method decodes the same prompts in the same batches, and the methods take turns batch by batch
    (batch 1 with every method, then batch 2, ...), so a change in machine load weighs on all of them alike;
  - each runner first decodes a short warm-up (allocations, first-call overheads) that is not timed;
  - with `repeats` > 1 each batch is timed that many times per method and the fastest is kept (outputs come from
    the first repeat; greedy and seeded sampling reproduce them).
A call's time is the wall clock around the whole generate call (prefill included), synchronised on CUDA.

Hugging Face baselines, on the same prompts and the same verifier module:
  - `hf`           `model.generate` with a complete GenerationConfig that does exactly what the engine does:
                   greedy, or sampling from softmax(logits / T) with top-p and nothing else (top_k=0, no
                   repetition penalty, no minimum length), stopping at the verifier's EOS; left-padded batches.
  - `hf-assisted`  HF assisted generation, batch 1 (HF supports no more): with `assistant_model` = the draft model
                   of a `draft-model` spec (drafting `num_assistant_tokens` = that spec's draft length, constant
                   schedule, no confidence cut-off, so it drafts what our chain drafts), else prompt lookup
                   (`prompt_lookup_num_tokens` 4, `max_matching_ngram_size` 3, like the `ngram` method); the
                   option assistant="prompt-lookup" / "draft-model" chooses explicitly.
                   Its tau is new tokens / verifier forwards (counted with a forward hook).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from draftheads.data.progress import EtaBar, quiet
from draftheads.eval.measure.metrics import MethodRun, Sample

HF_METHODS = ("hf", "hf-assisted")


@dataclass
class MethodSpec:
    """One row of the comparison: an engine method with its draft and options, or an HF baseline."""

    method: str
    """`autoregressive`, `ngram`, `draft-model`, `medusa`, `eagle`, or `hf` / `hf-assisted`."""
    draft: Any = None
    """What the method drafts with: a folder / name, or a module (see `SpeculativeDecoder.from_pretrained`)."""
    options: dict = field(default_factory=dict)
    """Method options (`draftheads.eval.engine.decoder.METHODS`), e.g. {"chain": 3} or {"depth": 5, "top_k": 3}."""
    label: str | None = None
    """Name in tables and plots; default the method name."""
    fused: bool = False
    """Run the engine's fused CUDA loop (`FusedDecoder(SpeculativeDecoder(...))`, eval/engine/cuda_loop.py)."""

    def __post_init__(self):
        self.label = self.label or self.method


@dataclass
class RunSettings:
    """How every method decodes."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 1
    seed: int = 0
    """Batch i samples with seed + i (the engine's generator; torch.manual_seed for HF)."""
    repeats: int = 1
    """Times each batch is timed per method; the fastest counts."""
    warmup_tokens: int = 16
    """Tokens of the untimed warm-up decode of the first prompt."""

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.repeats < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}, batch_size={self.batch_size}, repeats="
                             f"{self.repeats}: expected each >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature={self.temperature}, top_p={self.top_p}: expected T >= 0, 0 < top_p <= 1")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eos_ids(verifier) -> list[int]:
    eos = verifier.config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def cut_at_eos(ids: list[int], eos: list[int]) -> list[int]:
    """The tokens up to and including the first EOS."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


# ---- runners: one generate call over a batch of prompts --------------------------------------------------------
class EngineRunner:
    """A method of this engine (`SpeculativeDecoder`, or `FusedDecoder` around one)."""

    def __init__(self, spec: MethodSpec, verifier, decoder):
        self.spec, self.verifier, self.decoder = spec, verifier, decoder
        drafter = decoder.drafter
        self.draft_tokens_per_call, self.max_depth = drafter.num_draft_tokens, drafter.max_depth
        self.lossless = drafter.typical is None
        self.description = drafter.describe()
        self.phase_seconds = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "other": 0.0}

    def generate(self, prompts: list[list[int]], settings: RunSettings, seed: int, max_new_tokens: int):
        out = self.decoder.generate(prompts, max_new_tokens, settings.temperature, settings.top_p, seed=seed)
        return out.output_ids, out.stats.accepted, out.stats

    def keep(self, stats) -> None:
        """Add the per-phase times of a kept (timed) call."""
        for phase in self.phase_seconds:
            self.phase_seconds[phase] += getattr(stats, f"time_{phase}_s")

    def details(self) -> dict:
        return {"drafter": self.description, "options": self.spec.options,
                "phase_seconds": dict(self.phase_seconds)}


class HFRunner:
    """Hugging Face `generate`, plain or assisted, on the verifier's own module."""

    def __init__(self, spec: MethodSpec, verifier, assistant: nn.Module | None = None, num_assistant_tokens: int = 4,
                 prompt_lookup_num_tokens: int = 4, max_matching_ngram_size: int = 3):
        from transformers import GenerationConfig

        self.spec, self.verifier = spec, verifier
        self.model = verifier.model
        self.assistant = assistant
        self.eos = eos_ids(verifier)
        pad = verifier.config.pad_token_id
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else 0)
        self.lossless = True
        self.draft_tokens_per_call = self.max_depth = 0
        self.assisted = spec.method == "hf-assisted"
        self.extra: dict = {}
        if self.assisted and assistant is not None:
            self.extra = {"num_assistant_tokens": num_assistant_tokens}
            self.assistant_config = GenerationConfig(num_assistant_tokens=num_assistant_tokens,
                                                     num_assistant_tokens_schedule="constant",
                                                     assistant_confidence_threshold=0.0)
        elif self.assisted:
            self.extra = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens,
                          "max_matching_ngram_size": max_matching_ngram_size}
        self.forwards = 0
        self.description = {"name": spec.method, "assistant": "draft model" if assistant is not None else
                            "prompt lookup" if self.assisted else None, **self.extra}

    def _count(self, module, args, kwargs):
        self.forwards += 1

    def config(self, settings: RunSettings, max_new_tokens: int):
        """A complete GenerationConfig: nothing left to the model's generation_config.json or HF's defaults."""
        from transformers import GenerationConfig

        sample = settings.temperature > 0
        return GenerationConfig(
            max_new_tokens=max_new_tokens, min_length=0, do_sample=sample, num_beams=1,
            temperature=settings.temperature if sample else 1.0, top_p=settings.top_p if sample else 1.0,
            top_k=0 if sample else None,  # HF's default top_k is 50 when sampling; greedy ignores it
            typical_p=1.0, min_p=None, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
            no_repeat_ngram_size=0, bad_words_ids=None, suppress_tokens=[], begin_suppress_tokens=[],
            eos_token_id=self.eos or None, pad_token_id=self.pad, use_cache=True, **(
                {k: v for k, v in self.extra.items() if k != "num_assistant_tokens"}))

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], settings: RunSettings, seed: int, max_new_tokens: int):
        if self.assisted and len(prompts) > 1:
            raise ValueError("hf-assisted runs one prompt per generate call (HF supports batch size 1 only)")
        dev = self.verifier.device
        T = max(map(len, prompts))
        ids = torch.full((len(prompts), T), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), T), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's next token sits at column T
            ids[b, T - len(p):] = torch.tensor(p)
            mask[b, T - len(p):] = 1
        kwargs = {}
        if self.assisted and self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        torch.manual_seed(seed)
        handle = self.model.register_forward_pre_hook(self._count, with_kwargs=True)
        saved = self.assistant.generation_config if "assistant_model" in kwargs else None
        self.forwards = 0
        try:
            if saved is not None:
                self.assistant.generation_config = self.assistant_config
            out = self.model.generate(ids.to(dev), attention_mask=mask.to(dev),
                                      generation_config=self.config(settings, max_new_tokens), **kwargs)
        finally:
            handle.remove()
            if saved is not None:
                self.assistant.generation_config = saved
        new = out[:, T:].tolist()
        outputs = [cut_at_eos(row, self.eos) for row in new]
        return outputs, None, self.forwards

    def details(self) -> dict:
        return {"drafter": self.description, "options": self.spec.options}


def build_runners(verifier, specs: list[MethodSpec], dtype=None) -> list:
    """A runner per spec, sharing the verifier. Engine drafters are built first (a Medusa-2 export merges its
    adapter into the verifier, which every runner must then see), HF runners last."""
    from draftheads.eval.drafters import make_drafter
    from draftheads.eval.engine.cuda_loop import FusedDecoder
    from draftheads.eval.engine.decoder import SpeculativeDecoder

    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"method labels must be unique; repeated: {', '.join(dup)}")
    runners: dict[str, Any] = {}
    drafters = {}
    for spec in specs:
        if spec.method not in HF_METHODS:
            drafters[spec.label] = make_drafter(spec.method, verifier, spec.draft, dtype=dtype, **spec.options)
    draft_model = next((s for s in specs if s.method == "draft-model"), None)
    for spec in specs:
        if spec.method in HF_METHODS:
            options = dict(spec.options)
            kind = options.pop("assistant", "draft-model" if draft_model is not None else "prompt-lookup")
            if spec.method == "hf" and "assistant" in spec.options:
                raise ValueError(f"{spec.label}: plain `hf` takes no assistant")
            if kind not in ("draft-model", "prompt-lookup"):
                raise ValueError(f"{spec.label}: assistant={kind!r}; expected 'draft-model' or 'prompt-lookup'")
            assistant, n = None, 4
            if spec.method == "hf-assisted" and kind == "draft-model":
                if draft_model is None:
                    raise ValueError(f"{spec.label}: assistant='draft-model' needs a draft-model method in the run")
                assistant = drafters[draft_model.label].runner.model
                n = drafters[draft_model.label].num_draft_tokens
            runners[spec.label] = HFRunner(spec, verifier, assistant, num_assistant_tokens=n, **options)
        else:
            dec = SpeculativeDecoder(verifier, drafters[spec.label], spec.method)
            runners[spec.label] = EngineRunner(spec, verifier, FusedDecoder(dec) if spec.fused else dec)
    return [runners[s.label] for s in specs]


def run_methods(verifier, specs: list[MethodSpec], prompts: list[tuple[str, list[int]]], settings: RunSettings,
                dtype=None, progress: bool | None = None, desc: str = "eval") -> list[MethodRun]:
    """Decode `prompts` ((id, token ids) pairs) with every spec; returns one MethodRun per spec, in order."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    runners = build_runners(verifier, specs, dtype)
    runs = [MethodRun(s.label, s.method, draft_tokens_per_call=r.draft_tokens_per_call, max_depth=r.max_depth,
                      lossless=r.lossless) for s, r in zip(specs, runners)]
    device = verifier.device
    B = settings.batch_size
    batches = [prompts[i: i + B] for i in range(0, len(prompts), B)]
    for runner in runners:  # warm-up, untimed: the first batch's shapes (buffers, KV caches), a few tokens
        first = [p[1] for p in batches[0]]
        if isinstance(runner, HFRunner) and runner.assisted:
            first = first[:1]
        runner.generate(first, settings, settings.seed, min(settings.warmup_tokens, settings.max_new_tokens))
    hf_forwards = {s.label: 0 for s in specs}
    bar = EtaBar(total=len(prompts) * len(specs), desc=desc, unit="prompt",
               disable=quiet() if progress is None else not progress)
    for batch_index, batch in enumerate(batches):
        seed = settings.seed + batch_index
        for spec, runner, run in zip(specs, runners, runs):
            bar.set_postfix_str(spec.label)
            # HF assisted generation takes one prompt per call; everything else takes the batch.
            groups = [[p] for p in batch] if isinstance(runner, HFRunner) and runner.assisted else [batch]
            for group in groups:
                ids = [p[1] for p in group]
                best, first_result = None, None
                for _ in range(settings.repeats):
                    _sync(device)
                    t0 = time.perf_counter()
                    result = runner.generate(ids, settings, seed, settings.max_new_tokens)
                    _sync(device)
                    dt = time.perf_counter() - t0
                    if first_result is None:
                        first_result = result
                    if best is None or dt < best[0]:
                        best = (dt, result)
                outputs, accepted, extra = first_result
                if isinstance(runner, EngineRunner):
                    runner.keep(best[1][2])
                else:
                    hf_forwards[spec.label] += extra
                run.call_seconds.append(best[0])
                for b, (pid, prompt) in enumerate(group):
                    run.samples.append(Sample(pid, list(prompt), list(outputs[b]),
                                              list(accepted[b]) if accepted is not None else None,
                                              call=len(run.call_seconds) - 1))
                bar.update(len(group))
    bar.close()
    for spec, runner, run in zip(specs, runners, runs):
        run.details = runner.details()
        if isinstance(runner, HFRunner):
            # Plain HF decoding is one token per row per forward by definition; assisted: tokens / forwards.
            run.verifier_calls = hf_forwards[spec.label] if runner.assisted else run.new_tokens
    return runs
