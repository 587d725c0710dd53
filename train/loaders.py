"""The run's data loaders: tokenised (or cached) rows in a shuffle that depends only on (seed, epoch), so every
process and every resume sees the same order.

    train_dl, eval_dl = get_dataloaders(cfg, tokenizer)          # a test can call make_dataloaders with its own data
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import DataLoader, Sampler

from draftheads.train.config import ConfigError, RunConfig


class EpochSampler(Sampler[int]):
    """A shuffle that depends only on (seed, epoch): the same order on every process and after every resume."""

    def __init__(self, length: int, seed: int, shuffle: bool = True):
        self.length, self.seed, self.shuffle, self.epoch = length, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.length))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())

    def __len__(self) -> int:
        return self.length


def make_dataloaders(train_ds, eval_ds, cfg: RunConfig, collate: Callable) -> tuple[DataLoader, DataLoader]:
    """Loaders over tokenised datasets; drop_last so every process sees whole batches."""
    if len(train_ds) < cfg.train.batch_size:
        raise ConfigError(
            f"training data has {len(train_ds)} sequences, fewer than train.batch_size={cfg.train.batch_size}; "
            "add data or lower the batch size")
    # Own generators: a loader without one draws its workers' base seed from the global RNG each time an iterator
    # starts, so a resumed run (one more iterator after the RNG state is restored) would draw different noise/dropout.
    train_dl = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=EpochSampler(len(train_ds), cfg.train.seed),
                          collate_fn=collate, drop_last=True, num_workers=cfg.train.num_workers,
                          generator=torch.Generator().manual_seed(cfg.train.seed))
    eval_dl = DataLoader(eval_ds, batch_size=cfg.train.batch_size, shuffle=False, collate_fn=collate,
                         num_workers=cfg.train.num_workers, generator=torch.Generator().manual_seed(cfg.train.seed))
    return train_dl, eval_dl


def get_dataloaders(cfg: RunConfig, tokenizer) -> tuple[DataLoader, DataLoader]:
    """Tokenised train / held-out loaders for a run (a test can call `make_dataloaders` with its own data)."""
    if cfg.features == "offline":  # the cached rows (the same rows, same order) with their verifier features
        from draftheads.data.hidden_states import cached_datasets, collate_cached

        return make_dataloaders(*cached_datasets(cfg), cfg, collate_cached)
    from draftheads.data.batching import build_datasets, collate

    train_ds, eval_ds = build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)
    return make_dataloaders(train_ds, eval_ds, cfg, collate)


def draft_vocab_counts(dataset, vocab_size: int, rows_per_chunk: int = 1024) -> torch.Tensor:
    """(V,) int64: how often each token is a training target (loss_mask = 1) in a dataset of token rows (what
    EAGLE-3's and DFlash's draft vocabularies are chosen from)."""
    from draftheads.models.eagle.vocab import count_tokens

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for rows in dataset.iter(batch_size=rows_per_chunk):  # (n, T) columns, read in chunks: no full copy in memory
        counts += count_tokens(torch.as_tensor(rows["input_ids"]), torch.as_tensor(rows["loss_mask"]), vocab_size)
    return counts
