"""Train the bundled demo model: a tiny Ouro-architecture looped LM on GSM8K train.

The network is the product's own module code (`rlt_engine.models.ouro.OuroForCausalLM`): sandwich
norms, a shared stack of layers looped `total_ut_steps` = 4 times, `model.norm` after every
loop, and the learned exit gate. Only the attention backend is ours: training runs every loop
over whole packed sequences, without a cache, each loop attending to its own K/V only (the Ouro
training semantics: one KV slot per (loop, layer)).

Stage 1 (whole model), the Ouro objective: with hazards λ_t = sigmoid(gate(h_t)), the exit
distribution is p_t = λ_t Π_{i<t}(1 - λ_i) for t < T-1 and p_{T-1} = Π_{i<T-1}(1 - λ_i); the loss
is Σ_t p_t · CE_t - β · H(p), averaged over tokens, with β annealed linearly.
Stage 2 (gate only, body frozen): per-token targets "stop once no later loop improves the
cross-entropy by more than a margin", fitted with binary cross-entropy on the hazards.

Examples:
    python tools/train_demo_model.py --out rlt_engine/assets/ouro-gsm8k-tiny --tokenizer-only
    python tools/train_demo_model.py --out rlt_engine/assets/ouro-gsm8k-tiny --device cuda
    python tools/train_demo_model.py --out /tmp/demo-smoke --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO_ROOT))

from rlt_engine.models.attention import AttentionMetadata  # noqa: E402
from rlt_engine.models.base import LoopedCausalLM  # noqa: E402
from rlt_engine.models.configs import parse_config  # noqa: E402
from rlt_engine.models.loader import init_dummy_weights, save_checkpoint  # noqa: E402
from rlt_engine.models.registry import model_class  # noqa: E402

# Ids 0, 1, 2 as in Ouro's vocabulary: bos = eos = 0, chat turns end with 2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = SPECIAL_TOKENS[0]
SYSTEM_PROMPT = "You are a helpful assistant."
# Ouro-1.4B's ChatML template, verbatim.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}{# Skip #}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")


def default_data_dir() -> Path:
    """GSM8K beside the checkout (../shared), else inside it (shared/), or $RLT_SHARED_DIR."""
    env = os.environ.get("RLT_SHARED_DIR")
    candidates = [Path(env)] if env else []
    candidates += [REPO_ROOT.parent / "shared", REPO_ROOT / "shared"]
    for base in candidates:
        if (base / "datasets" / "gsm8k" / "train.jsonl").is_file():
            return base / "datasets" / "gsm8k"
    return candidates[0] / "datasets" / "gsm8k"


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


@dataclass
class TrainOptions:
    out: Path
    data_dir: Path = field(default_factory=default_data_dir)
    log: Path | None = None  # default: <out>/training_log.json
    device: str = "auto"
    seed: int = 0
    # Data and tokenizer
    vocab_size: int = 4096
    seq_len: int = 256
    val_docs: int = 200  # last problems of train.jsonl, held out for monitoring
    max_docs: int | None = None  # smoke runs use a few hundred problems
    chat_every: int = 4  # every k-th problem as a ChatML chat (0: none)
    retrain_tokenizer: bool = False
    # Architecture (Ouro keys; 4 loops)
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 768
    num_loops: int = 4
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # Stage 1
    steps: int = 2400
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.1  # on embeddings and on each residual branch (training only)
    gate_bias_init: float = -1.4  # λ ≈ 0.2: most exit mass starts on the deepest loop
    keep_best: bool = True  # end stage 1 at the evaluation with the lowest val CE at full depth
    beta: float = 0.1  # entropy bonus at the start ...
    beta_final: float = 0.05  # ... annealed linearly to this
    # Stage 2 (gate only)
    gate_steps: int = 300
    gate_lr: float = 3e-3
    gate_margin: float = 0.05  # nats a later loop must gain for the token to keep looping
    # Logging
    log_every: int = 50
    eval_every: int = 400
    eval_batches: int = 8
    amp: bool = True  # bf16 autocast on CUDA

    @classmethod
    def smoke(cls, out: Path, **overrides: Any) -> TrainOptions:
        """A seconds-long CPU run exercising every code path (tests, pre-flight checks)."""
        values: dict[str, Any] = dict(
            vocab_size=384,
            seq_len=64,
            val_docs=16,
            max_docs=240,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            steps=6,
            batch_size=4,
            warmup=2,
            gate_steps=3,
            log_every=2,
            eval_every=3,
            eval_batches=2,
        )
        values.update(overrides)
        return cls(out=out, **values)


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainOptions, bool]:
    """Command line -> (options, tokenizer_only)."""
    defaults = TrainOptions(out=Path("."))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--tokenizer-only", action="store_true", help="write tokenizer + config only")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (seconds) of every stage")
    for name, value in asdict(defaults).items():
        if name == "out":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif name in ("data_dir", "log"):
            p.add_argument(flag, type=Path, default=None)
        elif name == "max_docs":
            p.add_argument(flag, type=int, default=None)
        else:
            p.add_argument(flag, type=type(value), default=None, help=f"default {value}")
    ns = vars(p.parse_args(argv))
    out, tokenizer_only, smoke = ns.pop("out"), ns.pop("tokenizer_only"), ns.pop("smoke")
    given = {k: v for k, v in ns.items() if v is not None}
    if smoke:
        given.setdefault("device", "cpu")
        return TrainOptions.smoke(out, **given), tokenizer_only
    return TrainOptions(out=out, **given), tokenizer_only


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def load_problems(path: Path, limit: int | None = None) -> list[dict[str, str]]:
    problems = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                problems.append({"question": row["question"], "answer": row["answer"]})
            if limit is not None and len(problems) >= limit:
                break
    return problems


def clean_answer(answer: str) -> str:
    """Drop the calculator annotations (`<<48/2=24>>`): they repeat the arithmetic written just
    before them, make the text longer, and are not what a reader (or the model) should emit."""
    return CALCULATOR_ANNOTATION.sub("", answer)


def plain_document(question: str, answer: str) -> str:
    return f"Question: {question}\nAnswer: {clean_answer(answer)}{EOS}"


def chat_document(question: str, answer: str) -> str:
    """The same problem as a ChatML chat exactly as CHAT_TEMPLATE renders it, so that chat
    requests to the demo model land on text it has seen."""
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n"
        f"<|im_start|>assistant\n{clean_answer(answer)}<|im_end|>\n{EOS}"
    )


def documents(problems: Sequence[dict[str, str]], chat_every: int) -> list[str]:
    """Training text: every `chat_every`-th problem as a chat, the rest as Question/Answer."""
    docs = []
    for i, pr in enumerate(problems):
        as_chat = chat_every > 0 and i % chat_every == chat_every - 1
        make = chat_document if as_chat else plain_document
        docs.append(make(pr["question"], pr["answer"]))
    return docs


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def tokenizer_training_text(docs: Sequence[str]) -> Iterator[str]:
    """Documents without special tokens: BPE merges must never span `<|...|>` markers."""
    pattern = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    for doc in docs:
        yield from (piece for piece in pattern.split(doc) if piece)


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE like Ouro's: digits split one by one, no prefix space, specials 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),  # first, so they get ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_training_text(docs), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} did not get id {i}")
    return tok


def save_tokenizer(tok: Any, out: Path, max_length: int) -> None:
    """HF layout as Ouro ships it: tokenizer.json, tokenizer_config.json (ChatML template
    inline) and special_tokens_map.json. Written by hand rather than by `save_pretrained`, whose
    output differs between transformers 4 and 5 (class name, template file): these files load
    with either through `load_tokenizer` (AutoTokenizer, offline)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS),
        "bos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "extra_special_tokens": {},
        "model_max_length": max_length,
        "pad_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": EOS,
    }
    _write_json(out / "tokenizer_config.json", config)
    special = {name: _special(EOS) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    _write_json(
        out / "special_tokens_map.json",
        {"additional_special_tokens": list(SPECIAL_TOKENS), **special},
    )


def _special(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_saved_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json"))


# --------------------------------------------------------------------------------------------
# Model config
# --------------------------------------------------------------------------------------------


def model_config(opts: TrainOptions) -> dict[str, Any]:
    """config.json with the keys of the real Ouro-1.4B config (minus its remote-code auto_map)."""
    return {
        "architectures": ["OuroForCausalLM"],
        "attention_dropout": 0.0,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "head_dim": opts.head_dim,
        "hidden_act": "silu",
        "hidden_size": opts.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": opts.intermediate_size,
        "layer_types": ["full_attention"] * opts.num_layers,
        "max_position_embeddings": opts.max_position_embeddings,
        "max_window_layers": opts.num_layers,
        "model_type": "ouro",
        "num_attention_heads": opts.num_heads,
        "num_hidden_layers": opts.num_layers,
        "num_key_value_heads": opts.num_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": opts.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "total_ut_steps": opts.num_loops,
        "early_exit_threshold": 1.0,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": opts.vocab_size,
    }


def write_config(cfg: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)


# --------------------------------------------------------------------------------------------
# Training attention backend and forward
# --------------------------------------------------------------------------------------------


@dataclass
class PackedMetadata(AttentionMetadata):
    """Rows are `batch` sequences of `seq_len` tokens, flattened sequence-major."""

    batch: int = 1
    seq_len: int = 1


class CausalSDPABackend:
    """`AttentionBackend` for training and scoring: causal attention inside each sequence over
    the K/V of the current call only. Every loop is a separate call, so a loop sees its own
    K/V and no other loop's, as in Ouro training. No cache is kept."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, PackedMetadata)
        b, t = meta.batch, meta.seq_len
        qs = q.view(b, t, *q.shape[1:]).transpose(1, 2)  # [B, heads, T, d]
        ks = k.view(b, t, *k.shape[1:]).transpose(1, 2)
        vs = v.view(b, t, *v.shape[1:]).transpose(1, 2)
        group = qs.shape[1] // ks.shape[1]
        if group > 1:  # GQA: each KV head serves `group` consecutive query heads
            ks = ks.repeat_interleave(group, dim=1)
            vs = vs.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return out.transpose(1, 2).reshape(b * t, *q.shape[1:])


def loop_hiddens(
    model: LoopedCausalLM, input_ids: torch.Tensor, backend: CausalSDPABackend
) -> list[torch.Tensor]:
    """The normed hidden state after each loop, [B*T, H] each, for input ids [B, T]."""
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).repeat(b)
    hidden = model.prelude(input_ids.reshape(-1))
    states = []
    for loop in range(model.num_loops):
        loops = torch.full_like(positions, loop)
        meta = PackedMetadata(positions=positions, loop_indices=loops, batch=b, seq_len=t)
        hidden = model.recurrent(hidden, meta, backend).hidden
        states.append(hidden)
    return states


def add_dropout(model: LoopedCausalLM, p: float) -> list[Any]:
    """Dropout on the embeddings and on each residual branch (after its sandwich norm, just
    before the residual add), as forward hooks: the model code stays the product's, and the
    hooks are inert in eval mode. GSM8K train is ~1.3M tokens, so a 5M-parameter model
    memorises it within a few epochs without this."""

    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return F.dropout(output, p, module.training)

    modules: list[torch.nn.Module] = [model.model.embed_tokens]
    for layer in model.model.layers:
        modules += [layer.input_layernorm_2, layer.post_attention_layernorm_2]
    return [m.register_forward_hook(hook) for m in modules] if p > 0 else []


def gate_logits(model: LoopedCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """The exit gate before its sigmoid, in fp32 outside autocast: the same arithmetic as
    `LoopedCausalLM.exit_hazard` (hazard = sigmoid of this), kept in logit space so that
    log λ and log(1 - λ) stay finite when λ saturates."""
    gate = model.model.early_exit_gate
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), gate.weight.float(), gate.bias.float()).squeeze(-1)


def loop_losses(
    model: LoopedCausalLM, hiddens: Sequence[torch.Tensor], targets: torch.Tensor
) -> torch.Tensor:
    """Per-token cross-entropy of each loop's read-out: [T_loops, rows], fp32."""
    flat = targets.reshape(-1)
    ce = [F.cross_entropy(model.coda(h).float(), flat, reduction="none") for h in hiddens]
    return torch.stack(ce)


def exit_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log p_t of the exit distribution from gate logits [T_loops, rows]: p_t = λ_t S_t for
    t < T-1, p_{T-1} = S_{T-1}, with S_t = Π_{i<t}(1 - λ_i) the mass still looping."""
    log_stop, log_go = F.logsigmoid(logits), F.logsigmoid(-logits)
    log_survive = torch.cumsum(log_go, 0) - log_go  # exclusive prefix sum: Σ_{i<t}
    return torch.cat((log_stop[:-1] + log_survive[:-1], log_survive[-1:]), 0)


@dataclass
class ObjectiveTerms:
    loss: torch.Tensor
    expected_ce: torch.Tensor
    entropy: torch.Tensor
    ce_per_loop: torch.Tensor  # [T_loops], detached
    exit_mass: torch.Tensor  # [T_loops] mean p_t, detached


def ouro_objective(ce: torch.Tensor, log_p: torch.Tensor, beta: float) -> ObjectiveTerms:
    """Σ_t p_t · CE_t - β · H(p), averaged over tokens."""
    p = log_p.exp()
    expected_ce = (p * ce).sum(0).mean()
    entropy = -(p * log_p).sum(0).mean()
    return ObjectiveTerms(
        loss=expected_ce - beta * entropy,
        expected_ce=expected_ce,
        entropy=entropy,
        ce_per_loop=ce.detach().mean(1),
        exit_mass=p.detach().mean(1),
    )


def gate_targets(ce: torch.Tensor, margin: float) -> torch.Tensor:
    """Stop labels for loops 0..T-2: 1 where no later loop lowers this token's CE by more than
    `margin` nats (running on would not help), else 0. Returns [T_loops - 1, rows]."""
    later = ce[1:].flip(0).cummin(0).values.flip(0)  # best CE over loops t+1..T-1
    return (ce[:-1] - later < margin).float()


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


def encode_documents(tok: Any, docs: Sequence[str]) -> list[torch.Tensor]:
    return [torch.tensor(e.ids, dtype=torch.long) for e in tok.encode_batch(list(docs))]


def epoch_windows(
    docs: Sequence[torch.Tensor], seq_len: int, seed: int, epoch: int
) -> torch.Tensor:
    """One epoch of training windows [n, seq_len + 1]: documents shuffled (seeded by epoch),
    concatenated, cut into windows, windows shuffled. Neighbouring windows share one token so
    every token is a target once."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(docs), generator=g).tolist()
    stream = torch.cat([docs[i] for i in order])
    n = (stream.numel() - 1) // seq_len
    windows = stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)
    return windows[torch.randperm(n, generator=g)]


def training_batches(
    docs: Sequence[torch.Tensor], seq_len: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    """Endless deterministic stream of [batch_size, seq_len + 1] batches (epoch after epoch)."""
    epoch = 0
    while True:
        windows = epoch_windows(docs, seq_len, seed, epoch)
        if windows.shape[0] < batch_size:
            raise ValueError(f"{windows.shape[0]} windows are too few for batch {batch_size}")
        for i in range(0, windows.shape[0] - batch_size + 1, batch_size):
            yield windows[i : i + batch_size]
        epoch += 1


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def make_deterministic(seed: int, device: torch.device) -> None:
    if device.type == "cuda":
        # Must be set before cuBLAS creates its first handle.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio` of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, opts: TrainOptions) -> torch.optim.Optimizer:
    # Weight decay on matrices only (not norms, not the gate bias).
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": opts.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8)


class Trainer:
    def __init__(self, opts: TrainOptions, model: LoopedCausalLM, device: torch.device) -> None:
        self.opts, self.model, self.device = opts, model, device
        self.backend = CausalSDPABackend()
        self.amp = opts.amp and device.type == "cuda"
        self.log: dict[str, list[dict[str, Any]]] = {"train": [], "val": [], "gate": []}
        self.start = time.perf_counter()
        self.best: tuple[float, int, dict[str, torch.Tensor]] | None = None

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp)

    def seconds(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return round(time.perf_counter() - self.start, 2)

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-loop per-token CE [T_loops, rows], gate logits [T_loops, rows])."""
        batch = batch.to(self.device, non_blocking=True)
        with self.autocast():
            hiddens = loop_hiddens(self.model, batch[:, :-1], self.backend)
            ce = loop_losses(self.model, hiddens, batch[:, 1:])
        logits = torch.stack([gate_logits(self.model, h) for h in hiddens])
        return ce, logits

    def beta(self, step: int) -> float:
        frac = step / max(1, self.opts.steps - 1)
        return self.opts.beta + (self.opts.beta_final - self.opts.beta) * frac

    def stage1(self, batches: Iterator[torch.Tensor], val: torch.Tensor) -> None:
        opts, model = self.opts, self.model
        optim = make_optimizer(model, opts)
        for step in range(opts.steps):
            lr = opts.lr * lr_factor(step, opts.steps, opts.warmup, opts.min_lr_ratio)
            for group in optim.param_groups:
                group["lr"] = lr
            ce, logits = self.forward(next(batches))
            terms = ouro_objective(ce, exit_log_probs(logits), self.beta(step))
            optim.zero_grad(set_to_none=True)
            terms.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
            optim.step()
            last = step == opts.steps - 1
            if step % opts.log_every == 0 or last:
                self.record_train(step, lr, terms, float(grad_norm))
            if (step + 1) % opts.eval_every == 0 or last:
                self.remember_best(step + 1, self.record_val("stage1", step + 1, val))
        if opts.keep_best and self.best is not None:
            ce, step, state = self.best
            model.load_state_dict(state)
            print(f"stage 1 ends with the weights of step {step} (val CE {ce:.4f})", flush=True)

    def remember_best(self, step: int, val_ce: list[float]) -> None:
        """Keep the weights with the lowest held-out CE at full depth (early stopping)."""
        if self.opts.keep_best and (self.best is None or val_ce[-1] < self.best[0]):
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.best = (val_ce[-1], step, state)

    @property
    def best_step(self) -> int:
        return self.opts.steps if self.best is None else self.best[1]

    def stage2(self, batches: Iterator[torch.Tensor], val: torch.Tensor) -> None:
        """Gate only: the body is frozen, so its forward runs without autograd."""
        opts, model = self.opts, self.model
        gate = model.model.early_exit_gate
        optim = torch.optim.AdamW(gate.parameters(), lr=opts.gate_lr, weight_decay=0.0)
        model.eval()  # no dropout: the gate learns from the hiddens inference will see
        for step in range(opts.gate_steps):
            lr = opts.gate_lr * lr_factor(step, opts.gate_steps, 0, opts.min_lr_ratio)
            for group in optim.param_groups:
                group["lr"] = lr
            with torch.no_grad():
                batch = next(batches).to(self.device)
                with self.autocast():
                    hiddens = loop_hiddens(model, batch[:, :-1], self.backend)
                    ce = loop_losses(model, hiddens, batch[:, 1:])
                targets = gate_targets(ce, opts.gate_margin)
            logits = torch.stack([gate_logits(model, h) for h in hiddens[:-1]])
            loss = F.binary_cross_entropy_with_logits(logits, targets)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            last = step == opts.gate_steps - 1
            if step % opts.log_every == 0 or last:
                entry = {
                    "step": step,
                    "lr": lr,
                    "bce": float(loss.detach()),
                    "stop_target_rate": targets.mean(1).tolist(),
                    "hazard_mean": torch.sigmoid(logits).mean(1).tolist(),
                    "seconds": self.seconds(),
                }
                self.log["gate"].append(entry)
                print(f"[gate {step:5d}] bce {entry['bce']:.4f}  seconds {entry['seconds']}")
                sys.stdout.flush()
        self.record_val("stage2", opts.gate_steps, val)

    def record_train(self, step: int, lr: float, terms: ObjectiveTerms, grad_norm: float) -> None:
        entry = {
            "step": step,
            "lr": lr,
            "loss": float(terms.loss.detach()),
            "expected_ce": float(terms.expected_ce.detach()),
            "entropy": float(terms.entropy.detach()),
            "ce_per_loop": [round(float(x), 4) for x in terms.ce_per_loop],
            "exit_mass": [round(float(x), 4) for x in terms.exit_mass],
            "grad_norm": grad_norm,
            "seconds": self.seconds(),
        }
        self.log["train"].append(entry)
        ce = " ".join(f"{x:.3f}" for x in entry["ce_per_loop"])
        mass = " ".join(f"{x:.2f}" for x in entry["exit_mass"])
        print(
            f"[step {step:5d}] loss {entry['loss']:.4f}  ce/loop {ce}  exit mass {mass}  "
            f"lr {lr:.2e}  seconds {entry['seconds']}",
            flush=True,
        )

    @torch.no_grad()
    def record_val(self, stage: str, step: int, val: torch.Tensor) -> list[float]:
        """Held-out CE per loop and mean exit mass; returns the CE per loop."""
        training = self.model.training
        self.model.eval()
        ce_sum = torch.zeros(self.model.num_loops, device=self.device)
        mass_sum = torch.zeros_like(ce_sum)
        rows = 0
        for i in range(0, val.shape[0], self.opts.batch_size):
            ce, logits = self.forward(val[i : i + self.opts.batch_size])
            ce_sum += ce.sum(1)
            mass_sum += exit_log_probs(logits).exp().sum(1)
            rows += ce.shape[1]
        self.model.train(training)
        entry = {
            "stage": stage,
            "step": step,
            "ce_per_loop": [round(float(x), 4) for x in ce_sum / rows],
            "exit_mass": [round(float(x), 4) for x in mass_sum / rows],
            "tokens": rows,
            "seconds": self.seconds(),
        }
        self.log["val"].append(entry)
        ce_text = " ".join(f"{x:.3f}" for x in entry["ce_per_loop"])
        mass = " ".join(f"{x:.2f}" for x in entry["exit_mass"])
        print(f"[val {stage} {step}] ce/loop {ce_text}  exit mass {mass}", flush=True)
        return entry["ce_per_loop"]


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def prepare_tokenizer(opts: TrainOptions, docs: Sequence[str], reuse: bool) -> Any:
    """Reuse the tokenizer already in `out` (keeps committed files byte-stable), or train one."""
    path = opts.out / "tokenizer.json"
    if reuse and path.is_file() and not opts.retrain_tokenizer:
        tok = load_saved_tokenizer(opts.out)
        if tok.get_vocab_size() != opts.vocab_size:
            raise SystemExit(
                f"{path} has {tok.get_vocab_size()} tokens, not --vocab-size {opts.vocab_size}; "
                "pass --retrain-tokenizer to replace it"
            )
        print(f"reusing tokenizer {path}", flush=True)
        return tok
    t0 = time.perf_counter()
    tok = train_tokenizer(docs, opts.vocab_size)
    save_tokenizer(tok, opts.out, opts.max_position_embeddings)
    print(f"trained tokenizer ({opts.vocab_size} tokens) in {time.perf_counter() - t0:.1f}s")
    return tok


def build_model(opts: TrainOptions, device: torch.device) -> LoopedCausalLM:
    cfg = parse_config(model_config(opts))
    model: LoopedCausalLM = model_class(cfg.model_type)(cfg)
    init_dummy_weights(model, opts.seed)  # N(0, 0.02) matrices, unit norms, zero biases
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(opts.gate_bias_init)
    return model.to(device).train()


def save_bf16(model: LoopedCausalLM, out: Path) -> int:
    """Write model.safetensors in bf16; returns its size in bytes."""
    state = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
    (path,) = save_checkpoint(state, out)
    path.chmod(0o644)  # safetensors writes 0600; package data must be world-readable
    return path.stat().st_size


def train(opts: TrainOptions, tokenizer_only: bool = False) -> dict[str, Any]:
    """Run the whole recipe; returns the training log (also written as JSON)."""
    device = pick_device(opts.device)
    make_deterministic(opts.seed, device)
    problems = load_problems(opts.data_dir / "train.jsonl", opts.max_docs)
    docs = documents(problems, opts.chat_every)
    tok = prepare_tokenizer(opts, docs, reuse=not tokenizer_only)
    write_config(model_config(opts), opts.out)
    if tokenizer_only:
        return {}

    encoded = encode_documents(tok, docs)
    train_docs, val_docs = encoded[: -opts.val_docs], encoded[-opts.val_docs :]
    val = epoch_windows(val_docs, opts.seq_len, opts.seed, epoch=0)[
        : opts.eval_batches * opts.batch_size
    ]
    model = build_model(opts, device)
    params = sum(p.numel() for p in model.parameters())
    tokens = sum(d.numel() for d in train_docs)
    print(
        f"device {device}  params {params:,}  train tokens {tokens:,} in {len(train_docs)} docs  "
        f"val windows {val.shape[0]}  steps {opts.steps} + gate {opts.gate_steps}",
        flush=True,
    )
    trainer = Trainer(opts, model, device)
    batches = training_batches(train_docs, opts.seq_len, opts.batch_size, opts.seed)
    hooks = add_dropout(model, opts.dropout)
    trainer.stage1(batches, val)
    for hook in hooks:
        hook.remove()
    stage1_seconds = trainer.seconds()
    trainer.stage2(batches, val)
    size = save_bf16(model, opts.out)
    log: dict[str, Any] = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters": params,
        "train_tokens_per_epoch": tokens,
        "epochs": opts.steps * opts.batch_size * opts.seq_len / tokens,
        "stage1_best_step": trainer.best_step,
        "seconds_stage1": stage1_seconds,
        "seconds_total": trainer.seconds(),
        "checkpoint_bytes": size,
        **trainer.log,
    }
    log_path = opts.log or opts.out / "training_log.json"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(json.dumps(log, indent=1) + "\n")
    print(f"wrote {opts.out} ({size:,} bytes of weights) and {log_path}", flush=True)
    return log


def main(argv: Sequence[str] | None = None) -> int:
    opts, tokenizer_only = parse_args(argv)
    train(opts, tokenizer_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
