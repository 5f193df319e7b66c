"""A real `rlt serve` in a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from processes import spawned

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0
DEMO_ARGS = ("demo", "--max-num-seqs", "16", "--dtype", "float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`rlt serve ARGS` (or `python SCRIPT ARGS` for a patched server) until `stop()`."""

    def __init__(
        self,
        *args: str,
        script: Path | None = None,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ) -> None:
        """`new_session`: the server leads its own process group (a terminal's Ctrl-C goes
        to the whole group)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        head = [str(script)] if script else ["-m", "rlt_cli.main", "serve"]
        command = [sys.executable, *head, *args, "--port", str(self.port), "--device", "cpu"]
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - a pipe could fill up; closed in stop()
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            # one intra-op thread, as the in-process tests use: on a busy 2-core machine
            # spinning OpenMP threads make the tiny model's kernels a hundred times slower
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=new_session,
        )

    def wait_healthy(self) -> ServerProcess:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {START_TIMEOUT_S} s:\n{self.output()}")

    def metric(self, name: str) -> float:
        """The sum of a metric's samples (all label sets) from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = [
            float(m.group(1))
            for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        ]
        if not values:
            raise KeyError(f"{name} not in /metrics")
        return sum(values)

    def engine_pid(self) -> int:
        """The engine process: the server's child that multiprocessing spawned."""
        kids = spawned(self.proc.pid)
        if not kids:
            raise RuntimeError("the server has no engine process")
        return kids[0]

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def output(self) -> str:
        if self._log.closed:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()
