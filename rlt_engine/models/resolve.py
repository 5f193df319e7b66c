"""Where a model name points: a local directory, a downloaded hub snapshot, or a known config."""

from __future__ import annotations

from pathlib import Path

from rlt_engine.models.registry import resolve_model_name

KNOWN_CONFIGS = Path(__file__).parent / "known_configs"
DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "ouro-gsm8k-tiny"
DEMO_ALIAS = "demo"
_KNOWN_BY_REPO = {"ByteDance/Ouro-1.4B": "ouro-1.4b.json"}


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_dir(name: str, revision: str | None = None, load_format: str = "auto") -> Path:
    """A directory holding config.json (+ weights unless load_format is dummy)."""
    if name == DEMO_ALIAS:
        if not (DEMO_DIR / "model.safetensors").is_file():
            raise ModelNotFoundError(f"the bundled demo model is missing from {DEMO_DIR}")
        return DEMO_DIR
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        repo_id, pinned = resolve_model_name(name)
    except ValueError:
        raise ModelNotFoundError(f"{name!r} is neither a directory nor a known model") from None
    from rlt_engine.hub import find_local_copy

    local = find_local_copy(repo_id, revision or pinned)
    if local is not None:
        return local
    if load_format == "dummy" and repo_id in _KNOWN_BY_REPO:
        return known_config_dir(repo_id)
    raise ModelNotFoundError(
        f"{name} is not downloaded; run `rlt download {name}` first "
        "(or use load_format='dummy' for random weights)"
    )


def known_config_dir(repo_id: str) -> Path:
    """A directory with only the real config.json, for dummy-weight runs without downloads."""
    import tempfile

    out = Path(tempfile.gettempdir()) / "rlt-known-configs" / repo_id.replace("/", "--")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_bytes((KNOWN_CONFIGS / _KNOWN_BY_REPO[repo_id]).read_bytes())
    return out


def default_model() -> tuple[str, str | None]:
    """The model used when none is named: a downloaded real Ouro, else the bundled demo.

    Returns (model name, a one-line notice for the user or None).
    """
    from rlt_engine.hub import find_local_copy

    repo_id, revision = resolve_model_name("ouro")
    if find_local_copy(repo_id, revision) is not None:
        return "ouro", None
    return DEMO_ALIAS, (
        "no model given and no Ouro checkpoint downloaded: using the bundled demo model "
        "(tiny, trained on GSM8K). Get the real one with `rlt download ouro`."
    )
