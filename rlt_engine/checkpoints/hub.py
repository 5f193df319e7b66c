"""Fetch and verify checkpoints from the Hugging Face Hub.

`download_model` resolves an alias to a pinned revision, returns an existing complete copy
without touching the network, and otherwise downloads only what the engine needs (config,
safetensors weights, tokenizer files; never the repository's `.py` code) and verifies it.
Verification (`verify_model_dir`, `KNOWN_SIZES`, ...) lives in `rlt_engine.checkpoints.verify`.
Importable without typer or rich; huggingface_hub's errors become one-line `HubError`s.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub import errors as hf_errors
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from rlt_engine.checkpoints.aliases import DEMO_ALIAS, DEMO_DIR, resolve_model_name
from rlt_engine.checkpoints.verify import _one_line, verify_model_dir

__all__ = [
    "ALLOW_PATTERNS",
    "IGNORE_PATTERNS",
    "TOKENIZER_FILES",
    "DownloadResult",
    "HubAccessError",
    "HubError",
    "HubUnreachableError",
    "ModelVerificationError",
    "download_model",
    "find_local_copy",
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
)
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    *TOKENIZER_FILES,
)
# Never remote code; only top-level files (subfolders hold other formats we do not load).
IGNORE_PATTERNS = ("*.py", "*/*")

# Seconds to wait for the Hub before calling it unreachable (connect and read of one request).
PROBE_TIMEOUT_S = 4.0
ETAG_TIMEOUT_S = 10.0

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class HubError(RuntimeError):
    """A download that cannot proceed; the message is one readable line."""


class HubUnreachableError(HubError):
    """The Hub cannot be reached (offline mode, no network, timeout, server error)."""


class HubAccessError(HubError):
    """The Hub answered, but the repository or revision is missing, gated or private."""


class ModelVerificationError(HubError):
    """The files on disk do not form a complete, readable checkpoint."""


@dataclass(frozen=True)
class DownloadResult:
    path: Path
    repo_id: str
    revision: str | None
    already_present: bool
    files: tuple[str, ...]
    total_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "repo_id": self.repo_id,
            "revision": self.revision,
            "already_present": self.already_present,
            "files": list(self.files),
            "total_bytes": self.total_bytes,
        }


@dataclass(frozen=True)
class _RemoteInfo:
    commit: str | None
    sizes: dict[str, int]


def download_model(
    name: str,
    *,
    revision: str | None = None,
    local_dir: str | Path | None = None,
    token: str | None = None,
    progress: type | None = None,
    cache_dir: str | Path | None = None,
) -> DownloadResult:
    """Make a verified copy of `name` (alias or `org/name`) available locally.

    `revision` overrides the alias's pinned revision. Files go to `local_dir` if given, else
    the Hugging Face cache. `progress` is a tqdm-compatible class for huggingface_hub's bars.
    Raises `ValueError` for an unknown alias and `HubError` subclasses for everything else.
    """
    if name == DEMO_ALIAS:  # ships inside the package: nothing to fetch
        if local_dir is None:
            return _result(DEMO_DIR, "rlt/demo", "bundled", already_present=True)
        return _copy_demo(Path(local_dir).expanduser())
    repo_id, pinned = resolve_model_name(name)
    revision = revision or pinned
    local, problems = _find_local_copy(repo_id, revision, local_dir, cache_dir)
    if local is not None:
        return _result(local, repo_id, _local_revision(local, revision), already_present=True)
    if _offline():
        detail = f" ({problems[0]})" if problems else ""
        raise HubUnreachableError(
            f"HF_HUB_OFFLINE is set and no complete local copy of {_where(repo_id, revision)} "
            f"exists{detail}; unset HF_HUB_OFFLINE or pass --local-dir with a complete copy"
        )
    with _quiet_retries():
        remote = _probe_hub(repo_id, revision, token)
        path = _fetch(repo_id, revision, local_dir, cache_dir, token, progress)
    commit = remote.commit or revision
    problems = verify_model_dir(path, repo_id=repo_id, revision=commit, expected=remote.sizes)
    if problems:
        raise ModelVerificationError(
            f"{path} failed verification: {'; '.join(problems)} "
            "(delete the damaged files and run the download again)"
        )
    return _result(path, repo_id, commit, already_present=False)


def _copy_demo(local_dir: Path) -> DownloadResult:
    """The bundled demo model's checkpoint files, copied into `local_dir`."""
    import shutil

    if local_dir.exists() and not local_dir.is_dir():
        raise ValueError(f"--local-dir {local_dir} exists and is not a directory")
    local_dir.mkdir(parents=True, exist_ok=True)
    present = True
    for name in _checkpoint_files(DEMO_DIR):
        target = local_dir / name
        source = DEMO_DIR / name
        if not (target.is_file() and target.read_bytes() == source.read_bytes()):
            shutil.copyfile(source, target)
            present = False
    return _result(local_dir, "rlt/demo", "bundled", already_present=present)


# ---------------------------------------------------------------------------- local copies


def find_local_copy(repo_id: str, revision: str | None) -> Path | None:
    """A complete, verified copy in the Hugging Face cache, found without network."""
    return _find_local_copy(repo_id, revision, None, None)[0]


def _find_local_copy(
    repo_id: str, revision: str | None, local_dir: str | Path | None, cache_dir: str | Path | None
) -> tuple[Path | None, list[str]]:
    """A complete, verified local copy (no network), or None and what is wrong with it."""
    if local_dir is not None:
        candidate: Path | None = Path(local_dir).expanduser()
        if not candidate.is_dir():
            return None, []
        recorded = _local_dir_commit(candidate)
        if recorded and revision and _COMMIT_RE.match(revision) and recorded != revision:
            return None, [f"{candidate} holds revision {recorded[:12]}, not {revision[:12]}"]
    else:
        candidate = _cached_snapshot(repo_id, revision, cache_dir)
        if candidate is None:
            return None, []
    problems = verify_model_dir(
        candidate, repo_id=repo_id, revision=_local_revision(candidate, revision)
    )
    return (candidate, []) if not problems else (None, problems)


def _cached_snapshot(
    repo_id: str, revision: str | None, cache_dir: str | Path | None
) -> Path | None:
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=True,
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return Path(path)


def _local_dir_commit(local_dir: Path) -> str | None:
    """The commit huggingface_hub recorded when it downloaded into `local_dir`, if any."""
    meta = local_dir / ".cache" / "huggingface" / "download" / "config.json.metadata"
    try:
        first = meta.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None
    return first if _COMMIT_RE.match(first) else None


def _local_revision(path: Path, requested: str | None) -> str | None:
    if _COMMIT_RE.match(path.name) and path.parent.name == "snapshots":
        return path.name
    return _local_dir_commit(path) or requested


def _result(
    path: Path, repo_id: str, revision: str | None, *, already_present: bool
) -> DownloadResult:
    files = tuple(sorted(_checkpoint_files(path)))
    total = sum((path / f).stat().st_size for f in files)
    return DownloadResult(path.resolve(), repo_id, revision, already_present, files, total)


def _checkpoint_files(path: Path) -> Iterable[str]:
    for entry in path.iterdir():
        if entry.is_file() and _wanted(entry.name):
            yield entry.name


def _wanted(filename: str) -> bool:
    return any(fnmatch(filename, p) for p in ALLOW_PATTERNS) and not any(
        fnmatch(filename, p) for p in IGNORE_PATTERNS
    )


# ---------------------------------------------------------------------------- network


# huggingface_hub logs every retry of a transient failure ("Retrying in 4s", "Trying to resume
# download...") straight to stderr; the outcome is reported once, as a HubError, instead.
_RETRY_LOGGERS = ("huggingface_hub.utils._http", "huggingface_hub.file_download")
_RETRY_NOTICES = ("Retrying in ", "Rate limited.", "Error while downloading from ")


class _RetryNoticeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        retry = message.startswith(_RETRY_NOTICES) or " thrown while requesting " in message
        return not retry


@contextmanager
def _quiet_retries() -> Iterator[None]:
    quiet = _RetryNoticeFilter()
    loggers = [logging.getLogger(name) for name in _RETRY_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _offline() -> bool:
    is_offline = getattr(constants, "is_offline_mode", None)
    return bool(is_offline() if callable(is_offline) else constants.HF_HUB_OFFLINE)


def _probe_hub(repo_id: str, revision: str | None, token: str | None) -> _RemoteInfo:
    """One quick request (no retries) that tells reachability, access and file sizes."""
    try:
        info = HfApi().model_info(
            repo_id, revision=revision, timeout=PROBE_TIMEOUT_S, files_metadata=True, token=token
        )
    except Exception as exc:
        mapped = _hub_error(exc, repo_id, revision)
        if mapped is None:
            raise
        raise mapped from exc
    sizes = {
        s.rfilename: int(s.size)
        for s in info.siblings or ()
        if s.size is not None and _wanted(s.rfilename)
    }
    return _RemoteInfo(commit=info.sha, sizes=sizes)


def _fetch(
    repo_id: str,
    revision: str | None,
    local_dir: str | Path | None,
    cache_dir: str | Path | None,
    token: str | None,
    progress: type | None,
) -> Path:
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            local_dir=local_dir,
            cache_dir=cache_dir,
            token=token,
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
            etag_timeout=ETAG_TIMEOUT_S,
            tqdm_class=progress,
        )
    except Exception as exc:
        mapped = _hub_error(exc, repo_id, revision)
        if mapped is None:
            raise
        raise mapped from exc
    return Path(path)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exception types of whichever HTTP client huggingface_hub uses."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, OfflineModeIsEnabled]
    for module in ("httpx2", "httpx", "requests"):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        for attr in ("TransportError", "ConnectionError", "Timeout"):
            cls = getattr(mod, attr, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                types.append(cls)
    return tuple(types)


def _hub_error(exc: BaseException, repo_id: str, revision: str | None) -> HubError | None:
    """Translate huggingface_hub / HTTP client errors into one-line `HubError`s."""
    where, endpoint = _where(repo_id, revision), constants.ENDPOINT
    if isinstance(exc, LocalEntryNotFoundError) and isinstance(exc.__cause__, HfHubHTTPError):
        # hf_hub_download wraps an HTTP error answer to a file's metadata request (a 403, a 5xx
        # after its retries) in "not in the local cache": the Hub answered, report its answer.
        return _hub_error(exc.__cause__, repo_id, revision)
    if isinstance(exc, GatedRepoError):
        return HubAccessError(f"{repo_id} is gated: accept its terms on the Hub and pass --token")
    if isinstance(exc, RepositoryNotFoundError):
        return HubAccessError(f"{repo_id} not found on {endpoint} or gated/private; pass --token")
    if isinstance(exc, RevisionNotFoundError):
        return HubAccessError(f"revision {revision!r} not found in {repo_id} on {endpoint}")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return HubAccessError(f"access to {repo_id} denied (HTTP {status}); pass --token")
        answer = f"HTTP {status}" if status else _one_line(exc)
        return HubUnreachableError(f"the Hub at {endpoint} failed for {where} ({answer})")
    if isinstance(exc, (LocalEntryNotFoundError, *_transport_errors())):
        cause = exc.__cause__ or exc
        return HubUnreachableError(
            f"cannot reach the Hub at {endpoint} ({type(cause).__name__}: {_one_line(cause)}) "
            f"and no complete local copy of {where}"
        )
    xet_error = getattr(hf_errors, "XetDownloadError", None)
    if xet_error is not None and isinstance(exc, xet_error):
        return HubUnreachableError(f"download of {where} failed: {_one_line(exc)}")
    return None


def _where(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision[:12] if revision else 'main'}"
