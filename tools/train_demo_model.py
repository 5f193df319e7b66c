"""Train the bundled demo model: the command line of the recipe in the package `demo_model`
beside this file, whose docstring (also `--help`) describes it.

Examples:
    python tools/train_demo_model.py --out rlt_engine/assets/ouro-gsm8k-tiny --tokenizer-only
    python tools/train_demo_model.py --out rlt_engine/assets/ouro-gsm8k-tiny --device cuda
    python tools/train_demo_model.py --out /tmp/demo-smoke --smoke
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO_ROOT))

from demo_model.train import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
