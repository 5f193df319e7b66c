"""The first request a fresh `rlt serve` answers, against the second: time to the first
streamed chunk and to the end, per server start (the demo model on the CPU).

    python benchmarks/first_request_cpu.py [--tree DIR] [--starts 3] [-- SERVE_ARGS...]
    python benchmarks/first_request_cpu.py -- --api-server-count 2

Each start runs `rlt serve demo` from `--tree` (a checkout; default this one) on a free port,
waits until /health answers and 3 s more (a server idles before its first client), then
streams two completions of 8 tokens one after the other. What a fresh server does once, on
the path of its first request (an import, a cache filled on first use), shows up as the
first TTFT above the second. One JSON line: the tree, the serve arguments and per start
(first TTFT ms, first end-to-end ms, second TTFT ms).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serving_host_cpu import free_port, wait_healthy  # a script of this directory

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "demo", "prompt": "Tom has 3 apples", "max_tokens": 8, "stream": True}


def stream_once(url: str) -> tuple[float, float]:
    """(ms to the first data chunk, ms to the end of the stream)."""
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and first is None:
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return 1000 * (first or total), 1000 * total


def one_start(tree: Path, serve_args: list[str]) -> tuple[float, float, float]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "rlt_cli.main", "serve", "demo", "--port", str(port),
               "--device", "cpu", "--dtype", "float32", *serve_args]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        with log.open("w") as out:
            proc = subprocess.Popen(command, cwd=tree, env=env, stdout=out, stderr=out)
        try:
            wait_healthy(url, proc, log, timeout=120)
            time.sleep(3)
            first_ttft, first_e2e = stream_once(url)
            second_ttft, _ = stream_once(url)
            return round(first_ttft, 1), round(first_e2e, 1), round(second_ttft, 1)
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=ROOT, help="a checkout to serve from")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("serve_args", nargs="*", help="after --: arguments for rlt serve")
    args = ap.parse_args()
    runs = [one_start(args.tree.resolve(), args.serve_args) for _ in range(args.starts)]
    print(json.dumps({"tree": str(args.tree), "serve_args": args.serve_args,
                      "first_ttft_ms, first_e2e_ms, second_ttft_ms": runs}))  # fmt: skip


if __name__ == "__main__":
    main()
