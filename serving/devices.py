"""Where an embedder runs and in what precision: CUDA in fp16 when present, else CPU fp32."""

from __future__ import annotations

from typing import Any

from serving.embedder import EmbedderError


def pick_device(requested: str = "auto") -> tuple[str, Any]:
    """(device, torch dtype): CUDA with fp16 when present and allowed, else CPU fp32."""
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EmbedderError("device 'cuda' requested but no CUDA GPU is available.")
        return requested, torch.float16
    return requested, torch.float32


_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def torch_dtype(dtype: Any) -> Any:
    """None/"auto" → None (device default); "fp32"/"bf16"/"fp16" → the torch dtype."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        import torch

        if dtype not in _DTYPES:
            raise EmbedderError(f"unknown dtype {dtype!r}; use auto, fp32, bf16 or fp16.")
        return getattr(torch, _DTYPES[dtype])
    return dtype
