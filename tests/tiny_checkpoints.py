"""Tiny random checkpoints in exact Hugging Face layout, for tests that need a model on disk.

- `write_tiny_ouro`: the real Ouro config keys at tiny sizes (GQA, 4 loops, exit gate), the
  REAL Ouro tokenizer files copied from tests/fixtures/ouro-1.4b (so vocab stays 49152).
- `write_tiny_nanbeige`: a Nanbeige-style config (head_dim != hidden/heads, GQA, 2 loops) and a
  small synthetic byte-level BPE tokenizer that mirrors the real one: bos `<|im_start|>`, eos
  `<|im_end|>`, a third stop token `<|endoftext|>` (the last three ids, as 166100..166102 are),
  a BOS prepended on every encode, and a ChatML template that starts with the BOS.

Weights are fp32, deterministic in `seed`, and scaled so activations stay O(1): attention scores
are far from uniform, logits have clear winners and exit hazards differ from token to token.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlt_engine.models.configs import parse_config
from rlt_engine.models.registry import model_class

REPO_ROOT = Path(__file__).resolve().parents[1]
# Optional data beside the repository (datasets, ...): tests that need it skip, saying so.
SHARED_DIR = Path(os.environ.get("RLT_SHARED_DIR", REPO_ROOT.parent / "shared"))
# The real Ouro-1.4B config and tokenizer files (no weights), checked in: tests/fixtures/README.md
OURO_REAL_DIR = REPO_ROOT / "tests" / "fixtures" / "ouro-1.4b"
OURO_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)

NANBEIGE_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 as in the real vocabulary
NANBEIGE_CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")  # the last three ids
NANBEIGE_BPE_VOCAB = 448
NANBEIGE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def tiny_ouro_config(**overrides: Any) -> dict[str, Any]:
    """The keys of the real Ouro-1.4B config.json, at tiny sizes."""
    cfg: dict[str, Any] = {
        "architectures": ["OuroForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_ouro.OuroConfig",
            "AutoModel": "modeling_ouro.OuroModel",
            "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        },
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "model_type": "ouro",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "transformers_version": "4.55.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 49152,
    }
    cfg.update(overrides)
    return _with_layer_lists(cfg, overrides)


def tiny_nanbeige_config(vocab_size: int, bos: int, eos: int, **overrides: Any) -> dict[str, Any]:
    """A Nanbeige4.2-style config.json at tiny sizes (head_dim 16 while hidden/heads is 8)."""
    cfg: dict[str, Any] = {
        "architectures": ["NanbeigeForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_nanbeige.NanbeigeConfig",
            "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM",
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "model_type": "nanbeige",
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_loops": 2,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 70000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.55.0",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    cfg.update(overrides)
    return cfg


def _with_layer_lists(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Keep the per-layer fields consistent with an overridden layer count."""
    layers = cfg["num_hidden_layers"]
    if "layer_types" not in overrides:
        cfg["layer_types"] = ["full_attention"] * layers
    if "max_window_layers" not in overrides:
        cfg["max_window_layers"] = layers
    return cfg


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def random_state_dict(config_dict: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """fp32 weights of the model class for `config_dict`, deterministic in `seed`.

    Matrices are N(0, 1/fan_in) (embeddings N(0, 1)), RMSNorm weights 1 + 0.1 N(0, 1), and the
    exit gate gets weight N(0, 1/hidden) and bias -1 + 0.5 N(0, 1) so hazards vary.
    """
    config = parse_config(config_dict)
    torch.manual_seed(seed)
    module = model_class(config.model_type)(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(_init_tensor(name, param, gen))
    return {name: t.detach().contiguous() for name, t in module.state_dict().items()}


def _init_tensor(name: str, param: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
    if name.endswith("early_exit_gate.bias"):
        return -1.0 + 0.5 * noise
    if name.endswith("norm.weight") or "layernorm" in name:
        return 1.0 + 0.1 * noise
    if name.endswith("embed_tokens.weight"):
        return noise
    return noise / param.shape[-1] ** 0.5  # Linear weight [out, in]: fan-in scaling


def _write_weights(out: Path, config_dict: dict[str, Any], seed: int) -> None:
    save_file(random_state_dict(config_dict, seed), str(out / "model.safetensors"))


def _write_config(out: Path, config_dict: dict[str, Any]) -> None:
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Ouro
# --------------------------------------------------------------------------------------------


def write_tiny_ouro(
    out_dir: str | Path,
    *,
    seed: int = 0,
    tokenizer_from: str | Path | None = OURO_REAL_DIR,
    **config_overrides: Any,
) -> Path:
    """Write a tiny Ouro checkpoint; copies the real tokenizer unless `tokenizer_from` is None."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_dict = tiny_ouro_config(**config_overrides)
    _write_config(out, config_dict)
    _write_weights(out, config_dict, seed)
    if tokenizer_from is not None:
        _copy_ouro_tokenizer(Path(tokenizer_from), out)
    return out


def _copy_ouro_tokenizer(src: Path, out: Path) -> None:
    missing = [name for name in OURO_TOKENIZER_FILES if not (src / name).is_file()]
    if missing:
        raise FileNotFoundError(f"Ouro tokenizer files {missing} not found in {src}")
    for name in OURO_TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)


# --------------------------------------------------------------------------------------------
# Nanbeige
# --------------------------------------------------------------------------------------------


def write_tiny_nanbeige(out_dir: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny Nanbeige checkpoint with its synthetic tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_nanbeige_tokenizer()
    tokenizer.save_pretrained(str(out))
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in NANBEIGE_CHAT_TOKENS}
    vocab_size = _round_up(len(tokenizer), 64)  # padded like the real 166144-row embedding
    config_dict = tiny_nanbeige_config(
        vocab_size, bos=ids["<|im_start|>"], eos=ids["<|im_end|>"], **config_overrides
    )
    _write_config(out, config_dict)
    _write_weights(out, config_dict, seed)
    return out


def build_nanbeige_tokenizer() -> Any:
    """Byte-level BPE trained on deterministic text, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=NANBEIGE_BPE_VOCAB,
        special_tokens=list(NANBEIGE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer)
    tok.add_special_tokens(list(NANBEIGE_CHAT_TOKENS))
    bos_id = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A",
        pair="<|im_start|> $A <|im_start|> $B",
        special_tokens=[("<|im_start|>", bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|endoftext|>"],
        chat_template=NANBEIGE_CHAT_TEMPLATE,
        model_max_length=2048,
    )


_WORD_TEXT = (
    "the a an of to in on at by for with from loop loops model token tokens cache block blocks "
    "depth exit gate layer layers head heads query key value sum two three four five six seven "
    "eight nine ten hundred number answer question request batch step steps plane planes read "
    "write copy shared weight weights hidden state prompt output input first last next early "
    "late fast slow small large tiny random seed test engine kernel graph memory page pages"
)


def synthetic_corpus(lines: int = 400, seed: int = 1234) -> list[str]:
    """Deterministic lines of words, numbers and punctuation (no randomness from the caller)."""
    rng = random.Random(seed)
    vocabulary = _WORD_TEXT.split()
    corpus = []
    for _ in range(lines):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.4:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words)
        corpus.append(line[0].upper() + line[1:] + rng.choice(".?!:;,"))
    return corpus


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
