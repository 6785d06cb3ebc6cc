"""The ONNX CPU embedders' model files: exported once, offline, cached beside the model.

A sentence-transformers model's transformer is exported to ONNX, as is (``fp32``, the CPU
default: the same vectors as sentence-transformers to 2e-7, run one text per thread without
padding) or with its matrix products quantized to int8 by ONNX Runtime (``int8``, dynamic
quantization: weights int8 per output channel, activations quantized per run). The int8
recipe was chosen by measurement on all-MiniLM-L6-v2 on a 2-core AVX2 CPU (no VNNI), 256
texts, against sentence-transformers fp32 (see docs/PITFALLS.md):

==========================================  ==========  =============================
recipe                                      speed-up    cosine to fp32 (mean / min)
==========================================  ==========  =============================
ONNX fp32 (no quantization)                 1.4-1.6x    1.0000 / 1.0000
int8 per tensor                             2.0-2.3x    0.952 / 0.926
int8 per channel                            2.0-2.2x    0.991 / 0.984
**int8 per channel, reduced range, MatMul** 2.0-2.2x    0.992 / 0.985
same, feed-forward outputs kept fp32        1.8x        0.994 / 0.991
==========================================  ==========  =============================

Reduced range (7-bit weights) avoids the saturation of AVX2's u8×s8 products; keeping the
embedding lookups (Gather) in fp32 costs nothing measurable.

``python -m serving.onnx_export [MODEL_DIR]`` caches both ahead of first use (``make`` does,
for the bundled model). The export runs in a child process:
``torch.onnx.export`` alters the live model it traces, and the exporter's memory is
returned when the child exits. Export and quantization are deterministic (the same
versions give byte-identical files), so every replica that exports the same model gets
the same file and the same :class:`~serving.embedder.ModelIdentity`.

Cache layout, next to the model directory ``<model>`` (or under
``~/.cache/streamrag/models`` when that is not writable), one directory per precision::

    <model>.int8/model.onnx     the quantized transformer (<model>.fp32/model.onnx: as is)
    <model>.int8/export.json    source weights hash, recipe, versions, sha256 of model.onnx
    <model>.int8.lock           held while exporting, so concurrent first uses export once

A cached file is used only if ``export.json`` names the current source weights, this
recipe, and the file's own sha256; anything else is exported again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from serving.embedder import EmbedderError
from serving.models import feed, weights_hash

log = logging.getLogger(__name__)

#: per precision, bumped whenever its export or quantization settings change: old caches are
#: re-exported
RECIPES = {"int8": "onnx17-int8-per-channel-reduced-range-matmul/1", "fp32": "onnx17-fp32/1"}
MODEL_FILE = "model.onnx"
META_FILE = "export.json"
#: the transformer inputs an export may take, in the order the traced wrapper receives them
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def cache_dir(model_dir: Path, precision: str = "int8") -> Path:
    """Where a model's ONNX file of ``precision`` lives: beside it if writable, else the user cache."""
    beside = model_dir.with_name(f"{model_dir.name}.{precision}")
    if os.access(model_dir.parent, os.W_OK):
        return beside
    digest = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "streamrag" / "models" / f"{model_dir.name}-{digest}.{precision}"


def file_sha256(path: Path) -> str:
    return str(feed(hashlib.sha256(), path).hexdigest())


def ensure_onnx(model_dir: Path, precision: str = "int8", source: str | None = None) -> tuple[Path, str]:
    """(model file of ``precision``: "int8" or "fp32", its sha256), exporting it first if the
    cache lacks a valid one. ``source``: the model's ``weights_hash`` when the caller already
    has it (hashed here otherwise)."""
    if precision not in RECIPES:
        raise EmbedderError(f"no ONNX export for precision {precision!r}; use {' or '.join(RECIPES)}.")
    target = cache_dir(model_dir, precision)
    try:
        return _ensure(model_dir, target, precision, source or weights_hash(model_dir))
    except OSError as exc:
        raise EmbedderError(f"cannot write the {precision} model cache at {target}: {exc}") from exc


def _ensure(model_dir: Path, target: Path, precision: str, source: str) -> tuple[Path, str]:
    recipe = RECIPES[precision]
    found = _cached(target, source, recipe)
    if found is not None:
        return target / MODEL_FILE, found
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be exporting the same model
        found = _cached(target, source, recipe)
        if found is not None:
            return target / MODEL_FILE, found
        log.info("exporting %s to ONNX %s in %s (once per model; ~15 s)", model_dir, precision, target)
        target.mkdir(exist_ok=True)
        (target / META_FILE).unlink(missing_ok=True)  # the metadata is the commit marker: written last
        done = subprocess.run(
            [sys.executable, "-m", "serving.onnx_export", "--child", str(model_dir), str(target), precision],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-8:])
            raise EmbedderError(f"exporting {model_dir} to ONNX {precision} failed:\n{tail}")
        sha = file_sha256(target / MODEL_FILE)
        meta = {"source_weights": source, "recipe": recipe, "sha256": sha, "versions": _versions()}
        tmp = target / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, target / META_FILE)
        return target / MODEL_FILE, sha


def _cached(target: Path, source: str, recipe: str) -> str | None:
    """The sha256 of a valid cached file, or None (absent, stale, or not what was written)."""
    try:
        meta = json.loads((target / META_FILE).read_text())
        if meta.get("source_weights") != source or meta.get("recipe") != recipe:
            log.info("the ONNX model in %s is stale (other weights or recipe): exporting again", target)
            return None
        sha = file_sha256(target / MODEL_FILE)
    except (OSError, ValueError):
        return None
    if sha != meta.get("sha256"):
        log.warning("the ONNX model in %s does not match its recorded sha256: exporting again", target)
        return None
    return sha


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "onnx", "onnxruntime")}


def export(model_dir: Path, target: Path, precision: str = "int8") -> None:
    """Export the transformer of ``model_dir`` to ONNX into ``target``, quantized if ``int8``."""
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # eager attention traces into plain ops; SDPA's tracing bakes Python branches in
    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    sample = tokenizer(["an example", "a longer example sentence"], padding=True, return_tensors="pt")
    names = [name for name in INPUTS if name in sample]

    class LastHidden(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any) -> Any:
            return self.inner(**dict(zip(names, args, strict=True))).last_hidden_state

    fp32 = target / "fp32.onnx.tmp"
    axes = {name: {0: "batch", 1: "tokens"} for name in [*names, "last_hidden_state"]}
    with torch.no_grad():
        torch.onnx.export(
            LastHidden(model),
            tuple(sample[name] for name in names),
            str(fp32),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    if precision == "fp32":
        os.replace(fp32, target / MODEL_FILE)
        return
    int8 = target / (MODEL_FILE + ".tmp")
    quantize_dynamic(
        fp32, int8, weight_type=QuantType.QInt8, per_channel=True, reduce_range=True, op_types_to_quantize=["MatMul"]
    )
    fp32.unlink()
    os.replace(int8, target / MODEL_FILE)


def main(argv: list[str] | None = None) -> int:
    """``python -m serving.onnx_export [MODEL_DIR]``: make sure both files are cached (install time).

    ``--child MODEL_DIR TARGET_DIR PRECISION`` is the export itself, run by :func:`ensure_onnx`.
    """
    args = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if len(args) == 4 and args[0] == "--child":
        export(Path(args[1]), Path(args[2]), args[3])
        return 0
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m serving.onnx_export [MODEL_DIR]  (default: the bundled model)", file=sys.stderr)
        return 2
    from serving.models import resolve_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        model_dir = resolve_model(args[0] if args else None)[1]
    except EmbedderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for precision in RECIPES:
        try:
            path, sha = ensure_onnx(model_dir, precision)
        except EmbedderError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{precision} model: {path} (sha256 {sha[:16]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
