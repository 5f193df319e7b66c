"""Model names rlt knows: hub aliases with pinned revisions, and the bundled demo model.

Kept free of torch imports so `rlt download` and `rlt --help` stay instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEMO_ALIAS = "demo"  # the bundled demo model
DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "ouro-gsm8k-tiny"


@dataclass(frozen=True)
class ModelAlias:
    name: str
    repo_id: str
    revision: str
    description: str


ALIASES: dict[str, ModelAlias] = {
    a.name: a
    for a in (
        ModelAlias(
            "ouro",
            "ByteDance/Ouro-1.4B",
            "574fa66cb8bf5abdc979642d01cf2b79b16bfab1",
            "Ouro 1.4B, 24 layers x 4 loops, learned exit gate",
        ),
        ModelAlias(
            "ouro-2.6b",
            "ByteDance/Ouro-2.6B",
            "1ed04250da1a9936042725d302e81c8fa2ab5abd",
            "Ouro 2.6B, 48 layers x 4 loops",
        ),
        ModelAlias(
            "ouro-thinking",
            "ByteDance/Ouro-1.4B-Thinking",
            "3aaa2224253a92ca45cf2e3d427c360e1ef9c93d",
            "Ouro 1.4B reasoning variant",
        ),
        ModelAlias(
            "ouro-2.6b-thinking",
            "ByteDance/Ouro-2.6B-Thinking",
            "f1edd81e7ac41355db670500ceaf204e0f73af68",
            "Ouro 2.6B reasoning variant",
        ),
        ModelAlias(
            "nanbeige",
            "Nanbeige/Nanbeige4.2-3B",
            "b82e54bd609793562a75cbf9337970a93369eab5",
            "Nanbeige4.2 3B, 22 layers x 2 loops, GQA",
        ),
    )
}

# Pinned revisions also apply when a user names the repository instead of the alias.
_PINNED_BY_REPO = {a.repo_id.lower(): a for a in ALIASES.values()}


def resolve_model_name(name: str) -> tuple[str, str | None]:
    """Alias or `org/name` -> (repo_id, pinned revision or None)."""
    alias = ALIASES.get(name.lower())
    if alias is not None:
        return alias.repo_id, alias.revision
    if name.count("/") != 1 or not all(name.split("/")):
        raise ValueError(
            f"unknown model {name!r}: use an alias ({alias_names()}) or an org/name repo id"
        )
    pinned = _PINNED_BY_REPO.get(name.lower())
    return name, pinned.revision if pinned else None


def alias_names() -> str:
    """Every model name rlt knows, for messages: the demo model and the hub aliases."""
    return ", ".join([DEMO_ALIAS, *ALIASES])
