"""Checkpoint verification (`checkpoints.verify`) and the no-network paths of download_model."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlt_engine.checkpoints import hub, verify

SHARED_TOKENIZER = Path(__file__).resolve().parent / "fixtures" / "ouro-1.4b"  # checked in
OURO_REPO = "ByteDance/Ouro-1.4B"
OURO_REV = "574fa66cb8bf5abdc979642d01cf2b79b16bfab1"


def write_tokenizer(directory: Path) -> None:
    """The real Ouro tokenizer files when on hand, else minimal stand-ins of the same names."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
    for name in (*names, "special_tokens_map.json"):
        source = SHARED_TOKENIZER / name
        if source.is_file():
            shutil.copyfile(source, directory / name)
    for name in names:
        if not (directory / name).exists():
            (directory / name).write_text("#version: 0.2\n" if name == "merges.txt" else "{}")


def write_checkpoint(directory: Path, *, sharded: bool = False) -> Path:
    """A tiny but complete checkpoint in Hugging Face layout."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "ouro", "vocab_size": 8}))
    write_tokenizer(directory)
    tensors = {"model.embed_tokens.weight": torch.zeros(8, 4), "lm_head.weight": torch.ones(8, 4)}
    if not sharded:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for i, (name, tensor) in enumerate(tensors.items(), start=1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({name: tensor}, str(directory / shard))
        weight_map[name] = shard
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_complete_checkpoint_verifies(tmp_path: Path) -> None:
    assert verify.verify_model_dir(write_checkpoint(tmp_path / "single")) == []
    assert verify.verify_model_dir(write_checkpoint(tmp_path / "sharded", sharded=True)) == []


def test_truncated_safetensors_header(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    weights.write_bytes(data[: 8 + length // 2])
    problems = verify.verify_model_dir(ckpt)
    assert len(problems) == 1 and "truncated safetensors header" in problems[0]


def test_truncated_tensor_data(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    assert "header describes" in " ".join(verify.verify_model_dir(ckpt))


def test_garbage_header(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"nope!")
    assert "does not parse" in " ".join(verify.verify_model_dir(ckpt))


def test_missing_shard(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, sharded=True)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    problems = verify.verify_model_dir(ckpt)
    assert problems == [
        "shard model-00002-of-00002.safetensors listed in model.safetensors.index.json is missing"
    ]


def test_shard_without_indexed_tensor(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, sharded=True)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "lacks 1 tensor(s)" in " ".join(verify.verify_model_dir(ckpt))


def test_missing_weights_config_and_tokenizer(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "vocab.json"):
        (ckpt / name).unlink()
    problems = verify.verify_model_dir(ckpt)
    assert "config.json is missing" in problems
    assert "no *.safetensors weights" in problems
    assert any(p.startswith("no tokenizer") for p in problems)


def test_missing_tokenizer_config(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    (ckpt / "tokenizer_config.json").unlink()
    assert verify.verify_model_dir(ckpt) == ["tokenizer_config.json is missing"]


def test_broken_config_json(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    (ckpt / "config.json").write_text('{"model_type": ')
    assert verify.verify_model_dir(ckpt)[0].startswith("config.json does not parse")


def test_size_mismatch_against_known_table(tmp_path: Path, monkeypatch) -> None:
    ckpt = write_checkpoint(tmp_path)
    actual = (ckpt / "model.safetensors").stat().st_size
    table = {(OURO_REPO, OURO_REV): {"model.safetensors": actual + 1}}
    monkeypatch.setattr(verify, "KNOWN_SIZES", table)
    problems = verify.verify_model_dir(ckpt, repo_id="bytedance/ouro-1.4b", revision=OURO_REV)
    assert problems == [f"model.safetensors is {actual:,} bytes, expected {actual + 1:,}"]
    # Other revisions and repos are not held to that table.
    assert verify.verify_model_dir(ckpt, repo_id=OURO_REPO, revision="0" * 40) == []
    assert verify.verify_model_dir(ckpt) == []


def test_published_ouro_size_is_known() -> None:
    assert verify.known_sizes(OURO_REPO, OURO_REV) == {"model.safetensors": 2_869_336_434}


def test_tiny_stand_in_for_pinned_ouro_fails_the_size_check(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    problems = verify.verify_model_dir(ckpt, repo_id=OURO_REPO, revision=OURO_REV)
    assert len(problems) == 1 and "expected 2,869,336,434" in problems[0]


def test_expected_sizes_from_the_hub(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    assert verify.verify_model_dir(ckpt, expected={"generation_config.json": 10}) == [
        "generation_config.json is missing"
    ]


def _no_network(*args, **kwargs):
    raise AssertionError("the network was used")


@pytest.fixture
def tiny_ouro(monkeypatch) -> None:
    """Tiny checkpoints stand in for Ouro-1.4B: drop its published sizes."""
    monkeypatch.setattr(verify, "KNOWN_SIZES", {})


def test_local_dir_already_present_without_network(tmp_path: Path, monkeypatch, tiny_ouro) -> None:
    monkeypatch.setattr(hub, "_probe_hub", _no_network)
    monkeypatch.setattr(hub, "_fetch", _no_network)
    ckpt = write_checkpoint(tmp_path / "ouro")
    result = hub.download_model("ouro", local_dir=ckpt)
    assert result.already_present and result.path == ckpt.resolve()
    assert (result.repo_id, result.revision) == (OURO_REPO, OURO_REV)
    assert "model.safetensors" in result.files and "config.json" in result.files
    assert json.loads(json.dumps(result.to_dict()))["already_present"] is True


def write_cache_snapshot(cache: Path, repo_id: str, revision: str, *, ref: str = "main") -> Path:
    """A snapshot in the huggingface_hub cache layout: blobs, symlinked snapshot files, refs."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    staged = write_checkpoint(cache / "staging")
    snapshot = repo_dir / "snapshots" / revision
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(staged.iterdir())):
        blob = repo_dir / "blobs" / f"{i:040x}"
        shutil.move(file, blob)
        (snapshot / file.name).symlink_to(blob)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / ref).write_text(revision)
    staged.rmdir()
    return snapshot


def test_cache_snapshot_already_present_without_network(
    tmp_path: Path, monkeypatch, tiny_ouro
) -> None:
    monkeypatch.setattr(hub, "_probe_hub", _no_network)
    monkeypatch.setattr(hub, "_fetch", _no_network)
    snapshot = write_cache_snapshot(tmp_path, OURO_REPO, OURO_REV)
    result = hub.download_model("ouro", cache_dir=tmp_path)
    assert result.already_present and result.path == snapshot.resolve()
    assert result.revision == OURO_REV


def test_incomplete_local_copy_is_downloaded_again(tmp_path: Path, monkeypatch, tiny_ouro) -> None:
    ckpt = write_checkpoint(tmp_path / "ouro")
    (ckpt / "config.json").unlink()
    calls: list[str | None] = []

    def fake_probe(repo_id, revision, token):
        return hub._RemoteInfo(commit=OURO_REV, sizes={})

    def fake_fetch(repo_id, revision, local_dir, cache_dir, token, progress):
        calls.append(revision)
        (Path(local_dir) / "config.json").write_text("{}")
        return Path(local_dir)

    monkeypatch.setattr(hub, "_probe_hub", fake_probe)
    monkeypatch.setattr(hub, "_fetch", fake_fetch)
    monkeypatch.setattr(hub, "_offline", lambda: False)
    result = hub.download_model("ouro", local_dir=ckpt)
    assert calls == [OURO_REV] and not result.already_present


def test_download_that_does_not_verify_raises(tmp_path: Path, monkeypatch, tiny_ouro) -> None:
    monkeypatch.setattr(hub, "_offline", lambda: False)
    monkeypatch.setattr(hub, "_probe_hub", lambda *a: hub._RemoteInfo(OURO_REV, {}))

    def fetch_without_config(repo_id, revision, local_dir, *rest):
        (write_checkpoint(Path(local_dir)) / "config.json").unlink()
        return Path(local_dir)

    monkeypatch.setattr(hub, "_fetch", fetch_without_config)
    with pytest.raises(hub.ModelVerificationError, match=r"config\.json is missing"):
        hub.download_model("ouro", local_dir=tmp_path / "dest")


def test_offline_mode_without_local_copy(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(hub, "_offline", lambda: True)
    monkeypatch.setattr(hub, "_probe_hub", _no_network)
    with pytest.raises(hub.HubUnreachableError, match="HF_HUB_OFFLINE"):
        hub.download_model("ouro", cache_dir=tmp_path)


def test_unknown_alias() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        hub.download_model("not-a-model")


def test_allow_patterns_never_fetch_code() -> None:
    assert hub._wanted("model.safetensors") and hub._wanted("tokenizer.json")
    assert not hub._wanted("modeling_ouro.py") and not hub._wanted("pytorch_model.bin")
    assert "*.py" in hub.IGNORE_PATTERNS


def test_the_bundled_demo_model_needs_no_download():
    from rlt_engine.checkpoints.hub import download_model
    from rlt_engine.checkpoints.resolve import DEMO_DIR

    result = download_model("demo")
    assert result.already_present and result.path == DEMO_DIR.resolve()
    assert "model.safetensors" in result.files
