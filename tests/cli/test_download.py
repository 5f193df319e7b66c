"""`rlt download` end to end, in subprocesses (env is read at import), never touching the real Hub.

The Hub is either unreachable (HF_ENDPOINT=http://127.0.0.1:9) or a small local fake that
speaks the few endpoints huggingface_hub uses, so the real download path is exercised too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED_TOKENIZER = ROOT / "tests" / "fixtures" / "ouro-1.4b"  # checked in
OURO_REPO = "ByteDance/Ouro-1.4B"
OURO_REV = "574fa66cb8bf5abdc979642d01cf2b79b16bfab1"
OURO_WEIGHT_BYTES = 2_869_336_434
UNREACHABLE = "http://127.0.0.1:9"


def run_rlt(
    *args: str, hf_home: Path, endpoint: str = UNREACHABLE, offline: bool = False
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(PYTHONPATH=str(ROOT), HF_HOME=str(hf_home), HF_ENDPOINT=endpoint, COLUMNS="200")
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "rlt_cli.main", "download", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result, time.monotonic() - start


def assert_one_error_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0]


def write_tokenizer(directory: Path) -> None:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
    for name in (*names, "special_tokens_map.json"):
        if (SHARED_TOKENIZER / name).is_file():
            shutil.copyfile(SHARED_TOKENIZER / name, directory / name)
    for name in names:
        if not (directory / name).exists():
            (directory / name).write_text("#version: 0.2\n" if name == "merges.txt" else "{}")


def write_sparse_safetensors(path: Path, total_bytes: int) -> None:
    """A valid safetensors file of exactly `total_bytes` (one U8 tensor, sparse on disk)."""
    data = total_bytes - 8
    for _ in range(4):  # the header's own length depends on the digits in it
        header = json.dumps({"weight": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}})
        header += " " * (-len(header) % 8)
        data = total_bytes - 8 - len(header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(total_bytes)


def write_ouro_checkpoint(directory: Path) -> Path:
    """Stand-in for Ouro-1.4B at the pinned revision: real tokenizer, full-size sparse weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "ouro"}))
    write_tokenizer(directory)
    write_sparse_safetensors(directory / "model.safetensors", OURO_WEIGHT_BYTES)
    return directory


def write_tiny_checkpoint(directory: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "ouro", "vocab_size": 8}))
    write_tokenizer(directory)
    save_file({"lm_head.weight": torch.ones(8, 4)}, str(directory / "model.safetensors"))
    return directory


# ------------------------------------------------------------------------ unreachable / offline


def test_unreachable_hub_fails_fast_with_one_line(tmp_path: Path) -> None:
    result, seconds = run_rlt("ouro", hf_home=tmp_path)
    assert_one_error_line(result, "cannot reach the Hub", "127.0.0.1:9", OURO_REPO)
    assert seconds < 15


@pytest.mark.slow
def test_silent_hub_times_out_within_seconds(tmp_path: Path) -> None:
    """A Hub that accepts connections but never answers (e.g. a dead proxy)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        result, seconds = run_rlt("ouro", hf_home=tmp_path, endpoint=endpoint)
    assert_one_error_line(result, "cannot reach the Hub", "Timeout")
    assert seconds < 15


def test_offline_mode_says_so(tmp_path: Path) -> None:
    result, seconds = run_rlt("ouro", hf_home=tmp_path, offline=True)
    assert_one_error_line(result, "HF_HUB_OFFLINE", OURO_REPO)
    assert seconds < 15


def test_unknown_alias(tmp_path: Path) -> None:
    result, _ = run_rlt("no-such-model", hf_home=tmp_path)
    assert_one_error_line(result, "unknown model 'no-such-model'")


def test_local_dir_already_present_without_network(tmp_path: Path) -> None:
    ckpt = write_ouro_checkpoint(tmp_path / "ouro")
    result, _ = run_rlt("ouro", "--local-dir", str(ckpt), hf_home=tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert "already present and verified" in result.stdout and str(ckpt) in result.stdout

    result, _ = run_rlt("ouro", "--local-dir", str(ckpt), "--json", hf_home=tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["already_present"] is True and info["path"] == str(ckpt.resolve())
    assert (info["repo_id"], info["revision"]) == (OURO_REPO, OURO_REV)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(info["files"])


def test_damaged_local_dir_needs_the_network(tmp_path: Path) -> None:
    ckpt = write_ouro_checkpoint(tmp_path / "ouro")
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.truncate(OURO_WEIGHT_BYTES - 1)
    result, _ = run_rlt("ouro", "--local-dir", str(ckpt), hf_home=tmp_path / "hf")
    assert_one_error_line(result, "cannot reach the Hub")


def test_hf_cache_already_present_offline(tmp_path: Path) -> None:
    repo_dir = tmp_path / "hf" / "hub" / "models--ByteDance--Ouro-1.4B"
    staged = write_ouro_checkpoint(tmp_path / "staged")
    snapshot = repo_dir / "snapshots" / OURO_REV
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for file in staged.iterdir():
        blob = repo_dir / "blobs" / hashlib.sha1(file.name.encode()).hexdigest()
        shutil.move(file, blob)
        (snapshot / file.name).symlink_to(blob)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(OURO_REV)

    for offline in (False, True):
        result, _ = run_rlt("ouro", "--json", hf_home=tmp_path / "hf", offline=offline)
        assert result.returncode == 0, result.stderr
        info = json.loads(result.stdout)
        assert info["already_present"] is True and info["revision"] == OURO_REV
        assert info["path"] == str(snapshot.resolve())
        assert info["total_bytes"] > OURO_WEIGHT_BYTES


# ------------------------------------------------------------------------ a local fake Hub

FAKE_REPO = "acme/tiny-looped"
FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """The Hub endpoints huggingface_hub needs for model_info + snapshot_download."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[str] = []
        # Set by a test to answer some requests itself: fault(request, path, body) -> handled
        self.fault: Callable[[BaseHTTPRequestHandler, str, bool], bool] | None = None
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.handle(self, body=True)

            def do_HEAD(self) -> None:
                hub.handle(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def blob_id(self, name: str) -> str:
        return hashlib.sha1(self.files[name]).hexdigest()

    def handle(self, request: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(request.path).path)
        self.requests.append(f"{request.command} {path}")
        if self.fault is not None and self.fault(request, path, body):
            return None
        api = f"/api/models/{FAKE_REPO}"
        if path.startswith("/api/models/") and path != api and not path.startswith(api + "/"):
            return self.reply(request, 404, b"{}", {"X-Error-Code": "RepoNotFound"}, body)
        if path.startswith(api):
            kind, _, rev = path[len(api) + 1 :].partition("/")  # "", revision/R or tree/R
            if rev.split("/")[0] not in (FAKE_COMMIT, "main", ""):
                return self.reply(request, 404, b"{}", {"X-Error-Code": "RevisionNotFound"}, body)
            payload = self.tree() if kind == "tree" else self.info()
            return self.reply(request, 200, json.dumps(payload).encode(), {}, body)
        name = path.rpartition("/")[2]
        if path.startswith(f"/{FAKE_REPO}/resolve/") and name in self.files:
            headers = {"X-Repo-Commit": FAKE_COMMIT, "ETag": f'"{self.blob_id(name)}"'}
            return self.reply(request, 200, self.files[name], headers, body)
        return self.reply(request, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)

    def info(self) -> dict[str, object]:
        siblings = [
            {"rfilename": n, "size": len(d), "blobId": self.blob_id(n)}
            for n, d in self.files.items()
        ]
        return {"id": FAKE_REPO, "sha": FAKE_COMMIT, "private": False, "siblings": siblings}

    def tree(self) -> list[dict[str, object]]:
        return [
            {"type": "file", "path": n, "size": len(d), "oid": self.blob_id(n)}
            for n, d in self.files.items()
        ]

    @staticmethod
    def reply(request, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        request.send_response(status)
        for key, value in {"Content-Type": "application/octet-stream", **headers}.items():
            request.send_header(key, value)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if body:
            request.wfile.write(data)


@pytest.fixture
def fake_hub(tmp_path: Path) -> Iterator[FakeHub]:
    staged = write_tiny_checkpoint(tmp_path / "repo")
    files = {p.name: p.read_bytes() for p in staged.iterdir()}
    files["modeling_tiny.py"] = b"raise SystemExit('remote code must never be fetched')\n"
    files["README.md"] = b"# tiny\n"
    hub = FakeHub(files)
    thread = threading.Thread(target=hub.server.serve_forever, daemon=True)
    thread.start()
    yield hub
    hub.server.shutdown()
    hub.server.server_close()


def test_download_from_a_fake_hub(tmp_path: Path, fake_hub: FakeHub) -> None:
    hf_home = tmp_path / "hf"
    result, _ = run_rlt(FAKE_REPO, "--json", hf_home=hf_home, endpoint=fake_hub.url)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["already_present"] is False and info["revision"] == FAKE_COMMIT
    snapshot = Path(info["path"])
    assert snapshot == hf_home / "hub" / "models--acme--tiny-looped" / "snapshots" / FAKE_COMMIT
    assert (snapshot / "model.safetensors").read_bytes() == fake_hub.files["model.safetensors"]
    assert not (snapshot / "modeling_tiny.py").exists() and not (snapshot / "README.md").exists()
    assert not any("modeling_tiny.py" in r or "README.md" in r for r in fake_hub.requests)

    fake_hub.requests.clear()
    result, _ = run_rlt(FAKE_REPO, hf_home=hf_home, endpoint=fake_hub.url, offline=False)
    assert result.returncode == 0, result.stderr
    assert "already present and verified" in result.stdout
    assert fake_hub.requests == []


def test_download_into_local_dir_from_a_fake_hub(tmp_path: Path, fake_hub: FakeHub) -> None:
    dest = tmp_path / "dest"
    args = (FAKE_REPO, "--local-dir", str(dest), "--revision", FAKE_COMMIT)
    result, _ = run_rlt(*args, hf_home=tmp_path / "hf", endpoint=fake_hub.url)
    assert result.returncode == 0, result.stderr
    assert "downloaded and verified" in result.stdout
    assert (dest / "config.json").is_file() and not (dest / "modeling_tiny.py").exists()


def test_repository_not_found(tmp_path: Path, fake_hub: FakeHub) -> None:
    result, _ = run_rlt("acme/missing", hf_home=tmp_path, endpoint=fake_hub.url)
    assert_one_error_line(result, "acme/missing not found", "--token")


def test_revision_not_found(tmp_path: Path, fake_hub: FakeHub) -> None:
    args = (FAKE_REPO, "--revision", "f" * 40)
    result, _ = run_rlt(*args, hf_home=tmp_path, endpoint=fake_hub.url)
    assert_one_error_line(result, "revision", "not found in acme/tiny-looped")


# ------------------------------------------------------------------------ Hub failures over HTTP

BIG_WEIGHTS = "model.safetensors"  # replaced by a 1 MiB file for the failure tests


def big_safetensors() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"lm_head.weight": torch.ones(8, 32768)})


def answer(status: int, *, on: str, method: str | None = None, **headers: str):
    """A fault: reply `status` (with X-Error-* headers) to the API (on="api") or to one file."""

    def fault(request: BaseHTTPRequestHandler, path: str, body: bool) -> bool:
        if method is not None and request.command != method:
            return False
        hit = (
            path.startswith("/api/")
            if on == "api"
            else path.endswith(f"/resolve/{FAKE_COMMIT}/{on}")
        )
        if hit:
            names = {"error_code": "X-Error-Code", "error_message": "X-Error-Message"}
            FakeHub.reply(request, status, b"{}", {names[k]: v for k, v in headers.items()}, body)
        return hit

    return fault


def drop_mid_file(hub: FakeHub, name: str, *, then: str):
    """A fault: the first GET of `name` announces its full Content-Length, sends half of it and
    closes the connection. Later GETs (huggingface_hub retries, with a Range header if it kept
    part of the file) are dropped before any response (then="refuse") or served (then="resume")."""
    state = {"dropped": False}

    def close(request: BaseHTTPRequestHandler) -> None:
        request.wfile.flush()
        request.close_connection = True
        request.connection.shutdown(socket.SHUT_RDWR)

    def fault(request: BaseHTTPRequestHandler, path: str, body: bool) -> bool:
        if request.command != "GET" or not path.endswith(f"/{name}"):
            return False
        data = hub.files[name]
        headers = {"X-Repo-Commit": FAKE_COMMIT, "ETag": f'"{hub.blob_id(name)}"'}
        if not state["dropped"]:
            state["dropped"] = True
            request.send_response(200)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                request.send_header(key, value)
            request.end_headers()
            request.wfile.write(data[: len(data) // 2])
            close(request)
            return True
        if then == "refuse":
            close(request)
            return True
        # huggingface_hub resumes from the last chunk it kept (it may have kept none: no Range)
        asked = request.headers.get("Range")
        start = int(asked.removeprefix("bytes=").partition("-")[0]) if asked else 0
        request.send_response(206 if asked else 200)
        if asked:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        for key, value in {**headers, "Content-Length": str(len(data) - start)}.items():
            request.send_header(key, value)
        request.end_headers()
        request.wfile.write(data[start:])
        return True

    return fault


def assert_no_partial_files(root: Path, hub: FakeHub, absent: str) -> None:
    """Under `root` (a --local-dir or the repo's cache folder): no temporary download, every
    checkpoint file and every content-addressed blob is whole, and `absent` is nowhere."""
    assert root.is_dir()
    for path in root.rglob("*"):
        assert not path.name.endswith(".incomplete"), path
        assert path.name != absent, path
        if path.is_file() and path.name in hub.files:  # local-dir files and snapshot links
            assert path.read_bytes() == hub.files[path.name], path
        if path.parent.name == "blobs":  # named by the ETag, the sha1 of the whole file
            assert hashlib.sha1(path.read_bytes()).hexdigest() == path.name, path


def _download(tmp_path: Path, hub: FakeHub, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run `rlt download` into the HF cache or a --local-dir; returns the target folder."""
    if mode == "cache":
        target = tmp_path / "hf" / "hub" / "models--acme--tiny-looped"
        result, _ = run_rlt(FAKE_REPO, hf_home=tmp_path / "hf", endpoint=hub.url)
    else:
        target = tmp_path / "dest"
        args = (FAKE_REPO, "--local-dir", str(target))
        result, _ = run_rlt(*args, hf_home=tmp_path / "hf", endpoint=hub.url)
    return result, target


@pytest.mark.parametrize(
    ("fault", "needles"),
    [
        (
            answer(403, on="api", error_code="GatedRepo"),
            ["acme/tiny-looped is gated", "--token"],
        ),
        (answer(401, on="api"), ["access to acme/tiny-looped denied (HTTP 401)", "--token"]),
        (answer(403, on="api"), ["access to acme/tiny-looped denied (HTTP 403)", "--token"]),
        (answer(500, on="api"), ["the Hub at http://127.0.0.1:", "failed for", "(HTTP 500)"]),
    ],
    ids=["gated", "401", "403", "500"],
)
def test_the_hub_refusing_the_repository(tmp_path: Path, fake_hub: FakeHub, fault, needles):
    fake_hub.fault = fault
    result, target = _download(tmp_path, fake_hub, "cache")
    assert_one_error_line(result, *needles)
    assert not target.exists() or not any(target.rglob("*.safetensors"))


GATED_FILE = answer(
    403,
    on=BIG_WEIGHTS,
    error_code="GatedRepo",
    error_message="Access to model acme/tiny-looped is restricted.",
)


@pytest.mark.parametrize("mode", ["cache", "local-dir"])
@pytest.mark.parametrize(
    ("fault", "needles"),
    [
        (GATED_FILE, ["acme/tiny-looped is gated", "--token"]),
        (answer(401, on=BIG_WEIGHTS), ["access to acme/tiny-looped denied (HTTP 401)"]),
        (answer(403, on=BIG_WEIGHTS), ["access to acme/tiny-looped denied (HTTP 403)"]),
        (answer(503, on=BIG_WEIGHTS, method="GET"), ["failed for", "(HTTP 503)"]),
    ],
    ids=["gated", "401", "403", "503"],
)
def test_the_hub_refusing_the_weights_leaves_no_partial_file(
    tmp_path: Path, fake_hub: FakeHub, fault, needles, mode: str
) -> None:
    """The repository answers, but the weights file does not (other files may download)."""
    fake_hub.files[BIG_WEIGHTS] = big_safetensors()
    fake_hub.fault = fault
    result, target = _download(tmp_path, fake_hub, mode)
    assert_one_error_line(result, *needles)
    assert_no_partial_files(target, fake_hub, absent=BIG_WEIGHTS)


@pytest.mark.parametrize("mode", ["cache", "local-dir"])
def test_a_connection_dropped_mid_file_leaves_no_partial_file(
    tmp_path: Path, fake_hub: FakeHub, mode: str
) -> None:
    fake_hub.files[BIG_WEIGHTS] = big_safetensors()
    fake_hub.fault = drop_mid_file(fake_hub, BIG_WEIGHTS, then="refuse")
    result, target = _download(tmp_path, fake_hub, mode)  # ~5 s: huggingface_hub retries
    assert_one_error_line(result, "cannot reach the Hub", "RemoteProtocolError", FAKE_REPO)
    assert_no_partial_files(target, fake_hub, absent=BIG_WEIGHTS)
    gets = [
        r for r in fake_hub.requests if r == f"GET /{FAKE_REPO}/resolve/{FAKE_COMMIT}/{BIG_WEIGHTS}"
    ]
    assert len(gets) > 1  # it did try to resume

    fake_hub.fault = None  # the Hub is back: the same command completes the copy
    result, target = _download(tmp_path, fake_hub, mode)
    assert result.returncode == 0, result.stderr
    assert "downloaded and verified" in result.stdout and result.stderr == ""
    assert len(list(target.rglob(BIG_WEIGHTS))) == 1
    for path in target.rglob(BIG_WEIGHTS):
        assert path.read_bytes() == fake_hub.files[BIG_WEIGHTS]


def test_a_dropped_connection_that_resumes_gives_the_exact_file(
    tmp_path: Path, fake_hub: FakeHub
) -> None:
    fake_hub.files[BIG_WEIGHTS] = big_safetensors()
    fake_hub.fault = drop_mid_file(fake_hub, BIG_WEIGHTS, then="resume")
    result, target = _download(tmp_path, fake_hub, "local-dir")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # the retry is not reported: it succeeded
    assert (target / BIG_WEIGHTS).read_bytes() == fake_hub.files[BIG_WEIGHTS]
    assert_no_partial_files(target, fake_hub, absent="none")
