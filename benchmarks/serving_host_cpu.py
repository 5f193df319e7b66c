"""What `rlt serve` costs the host per streamed token, apart from the model (Linux, CPU or GPU).

Starts `rlt serve` on MODEL in a subprocess, sends `rlt bench --url` closed-loop runs at each
concurrency (each after a warm-up run at that concurrency, not reported), and reads the CPU
time of the server's threads from /proc before and after each run: the main thread runs the
event loop (HTTP parsing, the SSE chunks, socket writes); the engine's work (planning,
launches, read backs, detokenization, torch's threads) is in the engine process, counted apart,
and the server's other threads read its events (a server from before the seventeenth session
ran the engine on one of those threads). With a model whose compute is negligible (the 64-wide
test checkpoint with the bundled model's tokenizer, `--tiny`) the engine side is host work too,
and microseconds per output token say how many tokens a second one core of this host can serve:

    python benchmarks/serving_host_cpu.py --tiny -c 64,256 --num-prompts 1024 --json

On the GPU the same split says whether the host keeps up with the device at a concurrency. Each
run also reports the CUDA graphs the server captured while it ran (from `/metrics`): a capture
on first use stalls every stream.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "ouro-tiny-official"
DEMO = ROOT / "rlt_engine" / "assets" / "ouro-gsm8k-tiny"


def tiny_model(into: Path) -> Path:
    """The 64-wide, 2-layer test checkpoint (vocabulary 4096) with the bundled model's
    tokenizer (the same vocabulary), so that detokenization runs as it would in a server."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(TINY / name, into / name)
    for path in DEMO.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, into / path.name)
    return into


def thread_cpu(pid: int) -> tuple[float, float]:
    """(main thread, every other thread) CPU seconds of process `pid`."""
    tick = os.sysconf("SC_CLK_TCK")
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        if int(tid) == pid:
            main += seconds
        else:
            other += seconds
    return main, other


def children_cpu(pid: int) -> float:
    """CPU seconds of every thread of `pid`'s child processes (the engine process of a
    server that runs one; 0 for a server whose engine is a thread)."""
    kids: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.update(int(k) for k in f.read().split())
        except FileNotFoundError:
            continue
    total = 0.0
    for kid in kids:
        try:
            total += sum(thread_cpu(kid))
        except FileNotFoundError:  # the child ended
            continue
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise SystemExit(f"the server exited with {proc.returncode}; its stderr ends:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


def graph_captures(url: str) -> tuple[float, float]:
    """(CUDA graphs captured, host seconds capturing) so far, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    names = ("rlt:cuda_graph_captures_total", "rlt:cuda_graph_capture_seconds_total")
    return totals.get(names[0], 0.0), totals.get(names[1], 0.0)


def bench(url: str, c: int, n: int, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, "-m", "rlt_cli.main", "bench", "--url", url,
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--num-prompts", str(n), "--max-concurrency", str(c), "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model to serve (default with --tiny: the tiny model)")
    ap.add_argument("--tiny", action="store_true", help="serve the tiny model (see above)")
    ap.add_argument("-c", "--concurrency", default="64,256")
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=128)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `rlt serve` flag")
    ap.add_argument("--server-root", type=Path, default=ROOT, help="a checkout to serve from (A/B)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model(Path(tmp) / "tiny"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable, "-m", "rlt_cli.main", "serve", model, "--port", str(port),
            "--max-num-seqs", str(max(concurrency)),
            "--num-blocks", str(max(concurrency) * 4 * 8),  # every request fits: no queueing on KV
            *args.serve_arg,
        ]  # fmt: skip
        # one torch thread: idle intra-op workers spin, which would read as engine time
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        log = Path(tmp) / "server.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=args.server_root, env=env, stdout=subprocess.DEVNULL, stderr=err
            )
        try:
            wait_healthy(url, proc, log)
            rows = []
            for c in concurrency:
                # a warm-up at this concurrency: the graph variants its waves need are
                # captured there (each run reports those captured while measuring)
                bench(url, c, args.warmup, args)
                main0, other0 = thread_cpu(proc.pid)
                engine0 = children_cpu(proc.pid)
                graphs0, capture0 = graph_captures(url)
                report = bench(url, c, args.num_prompts, args)
                graphs1, capture1 = graph_captures(url)
                main1, other1 = thread_cpu(proc.pid)
                engine1 = children_cpu(proc.pid)
                tokens = report["total_output_tokens"]
                row = {
                    "concurrency": c,
                    "num_prompts": args.num_prompts,
                    "duration_s": report["duration_s"],
                    "output_tokens_per_s": report["output_throughput"],
                    "tokens_per_chunk": report["tokens_per_chunk"],
                    "ttft_ms_p50": report["ttft_ms"]["median"],
                    "tpot_ms_p50": report["tpot_ms"]["median"],
                    "ttft_ms_p99": report["ttft_ms"]["p99"],
                    "e2e_ms_p50": report["e2e_ms"]["median"],
                    "e2e_ms_p99": report["e2e_ms"]["p99"],
                    "itl_ms_p99": report["itl_ms"]["p99"],
                    "event_loop_cpu_s": main1 - main0,
                    "other_threads_cpu_s": other1 - other0,
                    "event_loop_us_per_token": (main1 - main0) / tokens * 1e6,
                    "other_threads_us_per_token": (other1 - other0) / tokens * 1e6,
                    "engine_process_cpu_s": engine1 - engine0,
                    "engine_process_us_per_token": (engine1 - engine0) / tokens * 1e6,
                    # captured on first use during the run: each stalled every stream
                    "graphs_captured": graphs1 - graphs0,
                    "graph_capture_s": capture1 - capture0,
                    "failed": report["failed"],
                    "errors": report["errors"],  # message -> count
                }
                rows.append(row)
                if not args.json:
                    print(
                        f"c={c}: {row['output_tokens_per_s']:.0f} tok/s, event loop "
                        f"{row['event_loop_us_per_token']:.1f} us/token, other threads "
                        f"{row['other_threads_us_per_token']:.1f} us/token, engine process "
                        f"{row['engine_process_us_per_token']:.1f} us/token, "
                        f"{row['failed']} failed",
                        flush=True,
                    )
                for message, count in report["errors"].items():
                    # a rate over completed requests only: never a silent one
                    print(f"c={c}: {count} failed: {message}", file=sys.stderr, flush=True)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        print(json.dumps({"model": args.model or "tiny", "runs": rows}))


if __name__ == "__main__":
    main()
