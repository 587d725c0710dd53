"""The one dtype table: the names configs, CLIs and file formats use for floating-point dtypes.

    to_dtype("bf16") -> torch.bfloat16;  dtype_name(torch.bfloat16) -> "bfloat16"

Canonical names are torch's (`float32`, `bfloat16`, `float16`); the short forms `fp32`, `bf16`, `fp16` are
accepted on input. `auto` means "whatever the checkpoint holds" (None).
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Canonical name -> dtype."""
ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def to_dtype(dtype: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """A dtype from a name (canonical or short), a dtype, None or `auto` (both None). Unknown names raise a
    ValueError naming `what` (the flag or key) and the choices."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    name = ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"{what}={dtype!r}: expected one of {', '.join([*DTYPES, *ALIASES, 'auto'])}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the form config.json files use for `torch_dtype`)."""
    return str(dtype).removeprefix("torch.")
