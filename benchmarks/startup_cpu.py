"""Start-up of `rlt generate` on the bundled demo model, on the CPU (issue 10 item 3).

Measures, with the source tree at --root on PYTHONPATH (so an older checkout can be measured with
the same script: `git archive COMMIT rlt_cli rlt_engine | tar -x -C /tmp/old`, then
`--root /tmp/old`; each child runs in --root: `python -m` and `-c` put the cwd first on sys.path):

- the wall time and peak RSS of the README's first command, warm (after one discarded run);
- `python -c "import torch"` and `import torch, transformers` wall times, the floor under it;
- the phases in one process: import torch, import the engine, `LLM()`, the generation;
- `python -X importtime -c "import rlt_cli.main"` (the CLI's own import, torch-free).

    python benchmarks/startup_cpu.py --runs 5 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Tom has 3 apples and buys 5 more. How many apples does he have?"
COMMAND = ["-m", "rlt_cli.main", "generate", PROMPT, "--chat", "--exit-threshold", "0.7"]
PHASES = """
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from rlt_engine.llm import LLM
from rlt_engine.sampling_params import SamplingParams
t2 = time.perf_counter()
llm = LLM()
t3 = time.perf_counter()
llm.chat([{"role": "user", "content": PROMPT}], SamplingParams(exit_threshold=0.7))
t4 = time.perf_counter()
plan = llm.engine.memory_plan.describe()
print(json.dumps({"import_torch_s": t1 - t0, "import_engine_s": t2 - t1, "llm_init_s": t3 - t2,
                  "generate_s": t4 - t3, "kv_cache": plan["kv_cache"],
                  "kv_bytes_total": plan["kv_bytes_total"]}))
"""


def _timed(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        args, env=env, cwd=env["PYTHONPATH"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{args} failed")
    return wall, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": args.root}
    py = sys.executable

    _timed([py, *COMMAND], env)  # warm the page cache and bytecode caches
    runs = [_timed([py, *COMMAND], env) for _ in range(args.runs)]
    floor = {
        code: statistics.median(_timed([py, "-c", code], env)[0] for _ in range(3))
        for code in ("import torch", "import torch, transformers")
    }
    phases = [
        json.loads(subprocess.run([py, "-c", f"PROMPT = {PROMPT!r}\n{PHASES}"], env=env,
                                  cwd=args.root, capture_output=True, text=True,
                                  check=True).stdout)
        for _ in range(3)
    ]  # fmt: skip
    cli_import = [py, "-X", "importtime", "-c", "import rlt_cli.main"]
    importtime = subprocess.run(
        cli_import, env=env, cwd=args.root, capture_output=True, text=True
    ).stderr
    cli_us = int(re.findall(r"\|\s*(\d+) \| rlt_cli\.main$", importtime, re.M)[-1])
    result = {
        "command": "rlt generate " + " ".join(repr(a) if " " in a else a for a in COMMAND[3:]),
        "root": args.root,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "runs": args.runs,
        "wall_s": [round(w, 3) for w, _ in runs],
        "wall_s_median": round(statistics.median(w for w, _ in runs), 3),
        "peak_rss_mb_median": round(statistics.median(r for _, r in runs) / 2**20, 1),
        "floor_wall_s_median": {k: round(v, 3) for k, v in floor.items()},
        "phases_median": {
            key: round(statistics.median(p[key] for p in phases), 3)
            for key in ("import_torch_s", "import_engine_s", "llm_init_s", "generate_s")
        },
        "kv_cache": phases[0]["kv_cache"],
        "import_rlt_cli_main_ms": round(cli_us / 1000, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
