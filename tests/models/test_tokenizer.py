"""Tokenizer loading (offline, no remote code), chat rendering and stop ids."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlt_engine.models.configs import load_config
from rlt_engine.models.tokenizer import (
    TokenizerError,
    load_tokenizer,
    render_chat,
    render_chat_text,
    stop_token_ids,
)

CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def ouro_tok(ouro_real_dir: Path):
    return load_tokenizer(ouro_real_dir)


@pytest.fixture(scope="module")
def nanbeige_tok(tiny_nanbeige_dir: Path):
    return load_tokenizer(tiny_nanbeige_dir)


# ---- Ouro (real tokenizer files) --------------------------------------------------------------


def test_ouro_loads_offline_without_remote_code(
    ouro_real_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("builtins.input", _no_prompt)  # a trust_remote_code prompt would fail
    tok = load_tokenizer(ouro_real_dir)
    assert len(tok) == 49152
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert "auto_map" in (ouro_real_dir / "config.json").read_text()  # the hazard is real


def test_ouro_encode_adds_no_bos(ouro_tok) -> None:
    assert 0 not in ouro_tok.encode("hello world")


def test_ouro_chat_is_chatml(ouro_tok) -> None:
    text = render_chat_text(ouro_tok, CHAT)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # Ouro's template adds a default system turn
    ids = render_chat(ouro_tok, CHAT)
    assert ids == ouro_tok.encode(text, add_special_tokens=False)
    assert ids[0] == ouro_tok.convert_tokens_to_ids("<|im_start|>")
    assert 0 not in ids  # no <|endoftext|> BOS anywhere
    assert ouro_tok.decode(ids) == text


def test_ouro_chat_without_generation_prompt(ouro_tok) -> None:
    text = render_chat_text(ouro_tok, CHAT, add_generation_prompt=False)
    assert text.endswith("What is 2 + 3?<|im_end|>\n")


def test_ouro_stop_ids(ouro_tok, ouro_real_dir: Path) -> None:
    assert stop_token_ids(ouro_tok, load_config(ouro_real_dir)) == (0, 2)


def test_tiny_ouro_carries_the_real_tokenizer(tiny_ouro_dir: Path, ouro_tok) -> None:
    tok = load_tokenizer(tiny_ouro_dir)
    assert tok.encode("looped models") == ouro_tok.encode("looped models")
    assert stop_token_ids(tok, load_config(tiny_ouro_dir)) == (0, 2)


# ---- Nanbeige (synthetic tokenizer mirroring the real one) -----------------------------------


def test_nanbeige_plain_encode_prepends_one_bos(nanbeige_tok, tiny_nanbeige_dir: Path) -> None:
    bos = load_config(tiny_nanbeige_dir).bos_token_id
    assert nanbeige_tok.bos_token_id == bos == nanbeige_tok.convert_tokens_to_ids("<|im_start|>")
    ids = nanbeige_tok.encode("the loop model")
    assert ids[0] == bos and bos not in ids[1:]
    assert nanbeige_tok.encode("the loop model", add_special_tokens=False) == ids[1:]


def test_nanbeige_chat_has_exactly_one_leading_bos(nanbeige_tok) -> None:
    bos = nanbeige_tok.bos_token_id
    ids = render_chat(nanbeige_tok, CHAT)
    assert ids[0] == bos and ids[1] != bos
    assert ids.count(bos) == 2  # the user turn and the generation prompt, nothing more
    assert nanbeige_tok.decode(ids) == render_chat_text(nanbeige_tok, CHAT)
    assert render_chat_text(nanbeige_tok, CHAT) == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_nanbeige_stop_ids(nanbeige_tok, tiny_nanbeige_dir: Path) -> None:
    config = load_config(tiny_nanbeige_dir)
    im_end, eot = nanbeige_tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert config.eos_token_ids == (im_end,)
    assert stop_token_ids(nanbeige_tok, config) == (im_end, eot)
    assert (config.bos_token_id, im_end, eot) == tuple(
        range(len(nanbeige_tok) - 3, len(nanbeige_tok))
    )


# ---- errors ----------------------------------------------------------------------------------


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"model directory .*absent does not exist"):
        load_tokenizer(tmp_path / "absent")


def test_unloadable_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        load_tokenizer(tmp_path)


def test_no_chat_template(tmp_path: Path, tiny_nanbeige_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_nanbeige_dir / name, tmp_path / name)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="no chat template"):
        render_chat(tok, CHAT)


def test_bad_messages(nanbeige_tok) -> None:
    with pytest.raises(TokenizerError, match="at least one message"):
        render_chat(nanbeige_tok, [])
    with pytest.raises(TokenizerError, match="'role' and 'content'"):
        render_chat(nanbeige_tok, [{"content": "hi"}])


def _no_prompt(*_args: object) -> str:
    raise AssertionError("tokenizer loading prompted for input")
