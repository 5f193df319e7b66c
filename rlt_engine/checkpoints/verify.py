"""Checkpoint verification: does a directory hold a complete, readable checkpoint?

`verify_model_dir` reads JSON files and safetensors headers only, never tensor data, and returns
the problems it finds (an empty list: it verifies). `KNOWN_SIZES` holds the file sizes published
for pinned revisions; `known_sizes` looks them up here, so patch `KNOWN_SIZES` in this module.
No huggingface_hub import: this module is cheap to import.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Sizes published for pinned revisions, checked whenever the (repo_id, revision) matches.
KNOWN_SIZES: dict[tuple[str, str], dict[str, int]] = {
    ("ByteDance/Ouro-1.4B", "574fa66cb8bf5abdc979642d01cf2b79b16bfab1"): {
        "model.safetensors": 2_869_336_434,
    },
}

_MAX_HEADER_BYTES = 100 * 1024 * 1024
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


def verify_model_dir(
    path: str | Path,
    *,
    repo_id: str | None = None,
    revision: str | None = None,
    expected: Mapping[str, int] | None = None,
) -> list[str]:
    """Problems that keep `path` from being a complete checkpoint (empty list: it verifies).

    Reads JSON files and safetensors headers, never tensor data. `expected` maps file names to
    sizes (e.g. from the Hub); the `KNOWN_SIZES` entry for (repo_id, revision) is added to it.
    """
    root = Path(path)
    if not root.is_dir():
        return [f"{root} is not a directory"]
    problems = _check_json(root, "config.json", required=True)
    problems += _check_json(root, "generation_config.json", required=False)
    problems += _check_tokenizer(root)
    problems += _check_weights(root)
    sizes = dict(known_sizes(repo_id, revision))
    sizes.update(expected or {})
    problems += _check_sizes(root, sizes)
    return problems


def known_sizes(repo_id: str | None, revision: str | None) -> dict[str, int]:
    """Published file sizes for (repo_id, revision) from `KNOWN_SIZES` (repo id case-blind)."""
    for (known_repo, known_rev), sizes in KNOWN_SIZES.items():
        if repo_id and known_repo.lower() == repo_id.lower() and known_rev == revision:
            return sizes
    return {}


def _check_json(root: Path, name: str, *, required: bool) -> list[str]:
    file = root / name
    if not file.is_file():
        return [f"{name} is missing"] if required else []
    try:
        json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [f"{name} does not parse: {_one_line(exc, 80)}"]
    return []


def _check_tokenizer(root: Path) -> list[str]:
    problems = _check_json(root, "tokenizer_config.json", required=True)
    has_model = (
        (root / "tokenizer.json").is_file()
        or (root / "tokenizer.model").is_file()
        or ((root / "vocab.json").is_file() and (root / "merges.txt").is_file())
    )
    if not has_model:
        problems.append("no tokenizer (tokenizer.json, tokenizer.model or vocab.json + merges.txt)")
    for name in ("tokenizer.json", "vocab.json", "special_tokens_map.json", "added_tokens.json"):
        problems += _check_json(root, name, required=False)
    return problems


def _check_weights(root: Path) -> list[str]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return _check_index(root, index)
    shards = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not shards:
        return ["no *.safetensors weights"]
    return [p for shard in shards for p in _check_safetensors(shard)[1]]


def _check_index(root: Path, index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        assert isinstance(weight_map, dict) and weight_map
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return [f"{index.name} does not parse or has no weight_map"]
    problems: list[str] = []
    for shard in sorted(set(weight_map.values())):
        if not (root / shard).is_file():
            problems.append(f"shard {shard} listed in {index.name} is missing")
            continue
        names, shard_problems = _check_safetensors(root / shard)
        problems += shard_problems
        absent = [t for t, s in weight_map.items() if s == shard and t not in names]
        if names and absent:
            problems.append(f"{shard} lacks {len(absent)} tensor(s) of the index, e.g. {absent[0]}")
    return problems


def _check_safetensors(file: Path) -> tuple[set[str], list[str]]:
    """Tensor names and problems of one safetensors file, from its header alone."""
    try:
        length, header = _read_header(file)
        end = _data_end(header)
    except (OSError, ValueError) as exc:
        return set(), [f"{file.name}: {exc}"]
    data_bytes = file.stat().st_size - 8 - length
    if end != data_bytes:
        return set(), [f"{file.name}: data is {data_bytes:,} bytes, header describes {end:,}"]
    return {n for n in header if n != "__metadata__"}, []


def _data_end(header: Mapping[str, Any]) -> int:
    """End of the data buffer described by a header, checking each tensor's extent."""
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in entry["data_offsets"])
            numel = 1
            for dim in entry["shape"]:
                numel *= int(dim)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"tensor {name} has a malformed header entry") from exc
        width = _DTYPE_BYTES.get(entry.get("dtype", ""))
        if not 0 <= begin <= stop or (width is not None and stop - begin != numel * width):
            raise ValueError(f"tensor {name} has inconsistent data offsets")
        end = max(end, stop)
    return end


def read_safetensors_header(file: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, without reading tensor data."""
    return _read_header(Path(file))[1]


def _read_header(file: Path) -> tuple[int, dict[str, Any]]:
    """(header length, header): 8-byte little-endian length, then that many bytes of JSON."""
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError("truncated safetensors file (no header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"implausible safetensors header length {length:,}")
        raw = f.read(length)
    if len(raw) < length:
        raise ValueError(f"truncated safetensors header ({len(raw):,} of {length:,} bytes)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"safetensors header does not parse: {_one_line(exc, 80)}") from exc
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise ValueError("safetensors header is not a JSON object of tensor entries")
    return length, header


def _check_sizes(root: Path, sizes: Mapping[str, int]) -> list[str]:
    problems = []
    for name, size in sorted(sizes.items()):
        file = root / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif (actual := file.stat().st_size) != size:
            problems.append(f"{name} is {actual:,} bytes, expected {size:,}")
    return problems


def _one_line(exc: BaseException, limit: int = 160) -> str:
    """An exception's message squeezed onto one line of at most `limit` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
