"""Where a model name points: a local directory, a downloaded hub snapshot, or a known config."""

from __future__ import annotations

from pathlib import Path

from rlt_engine.checkpoints.aliases import DEMO_ALIAS, DEMO_DIR, alias_names, resolve_model_name

__all__ = ["DEMO_ALIAS", "DEMO_DIR", "KNOWN_CONFIGS", "ModelNotFoundError", "resolve_model_dir"]

KNOWN_CONFIGS = Path(__file__).parent / "known_configs"
# The bundled config of every alias's repository (known_configs/README.md says where each is from).
_KNOWN_BY_REPO = {
    "ByteDance/Ouro-1.4B": "ouro-1.4b",
    "ByteDance/Ouro-2.6B": "ouro-2.6b",
    "ByteDance/Ouro-1.4B-Thinking": "ouro-1.4b-thinking",
    "ByteDance/Ouro-2.6B-Thinking": "ouro-2.6b-thinking",
    "Nanbeige/Nanbeige4.2-3B": "nanbeige4.2-3b",
}


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
        raise ModelNotFoundError(
            f"{name!r} is neither a directory nor a known model (aliases: {alias_names()})"
        ) from None
    from rlt_engine.checkpoints.hub import find_local_copy

    local = find_local_copy(repo_id, revision or pinned)
    if local is not None:
        return local
    known = known_config_dir(repo_id)
    if load_format == "dummy":
        if known is not None:
            return known
        raise ModelNotFoundError(
            f"{name} is not downloaded and rlt has no bundled config for it, which "
            f"load_format='dummy' needs; run `rlt download {name}` first"
        )
    dummy = " (or use load_format='dummy' for random weights)" if known is not None else ""
    raise ModelNotFoundError(f"{name} is not downloaded; run `rlt download {name}` first{dummy}")


def known_config_dir(repo_id: str) -> Path | None:
    """The bundled directory holding only the real config.json of `repo_id` (None: not
    bundled), for dummy-weight runs without downloads. Nothing is written anywhere."""
    for repo, dirname in _KNOWN_BY_REPO.items():
        if repo.lower() == repo_id.lower():
            return KNOWN_CONFIGS / dirname
    return None


def default_model() -> tuple[str, str | None]:
    """The model used when none is named: a downloaded real Ouro, else the bundled demo.

    Returns (model name, a one-line notice for the user or None).
    """
    from rlt_engine.checkpoints.hub import find_local_copy

    repo_id, revision = resolve_model_name("ouro")
    if find_local_copy(repo_id, revision) is not None:
        return "ouro", None
    return DEMO_ALIAS, (
        "no model given and no Ouro checkpoint downloaded: using the bundled demo model "
        "(tiny, trained on GSM8K). Get the real one with `rlt download ouro`."
    )
