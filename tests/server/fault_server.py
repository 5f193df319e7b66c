"""`rlt serve` with one fault planted: a request whose stop strings include FAULT_MARKER
fails inside its detokenizer after a few tokens, as a tokenizer bug would. Everything else
is the real server. Usage: python tests/server/fault_server.py [rlt serve args]."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlt_cli.main import app
from rlt_engine.detokenizer import IncrementalDetokenizer

FAULT_MARKER = "<<inject-fault>>"
_push = IncrementalDetokenizer.push


def _faulty_push(self: IncrementalDetokenizer, token_id: int) -> bool:
    if FAULT_MARKER in self.stop and len(self._ids) >= 3:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted fault")
    return _push(self, token_id)


IncrementalDetokenizer.push = _faulty_push  # type: ignore[method-assign]

if __name__ == "__main__":
    app(["serve", *sys.argv[1:]], prog_name="rlt")
