"""Build a looped model from a Hugging Face directory: config.json plus safetensors weights
(one `model.safetensors` or shards listed in `model.safetensors.index.json`), or random
("dummy") weights with the real config for benchmarks without downloads.

Memory: every parameter is allocated once, empty, on the target device in the target dtype while
the module is built, then filled one tensor at a time, so no second full copy ever exists.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from rlt_engine.models.base import LoopedCausalLM
from rlt_engine.models.configs import CheckpointError, load_config
from rlt_engine.models.layers import RMSNorm
from rlt_engine.models.registry import model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = {"F32", "BF16", "F16"}
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"  # some HF checkpoints store this derived buffer
_SHARD_PATTERN = re.compile(r"model-\d+-of-\d+\.safetensors")


__all__ = ["CheckpointError", "init_dummy_weights", "load_model", "load_weights", "save_checkpoint"]


@contextmanager
def _empty_parameters(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Build modules whose parameters are allocated once, empty, on `device` in `dtype` (floats),
    without running their init.

    Each parameter a module makes is replaced, as it is registered, by an empty tensor on the
    target; the module's own CPU tensor is never touched, so its pages are never really
    allocated, and no second copy of the model ever exists. `reset_parameters` of linear and
    embedding layers is skipped: every tensor is filled afterwards, from the checkpoint or by
    `init_dummy_weights`. (Building on the meta device instead sends module construction and
    `to_empty` through torch's Python reference ops, whose first use imports torch._dynamo and
    sympy: about 2.5 s of start-up.) Buffers are made as usual (they are small and derived).
    """
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    register = nn.Module.register_parameter

    def register_empty(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            kind = dtype if param.is_floating_point() else param.dtype
            empty = torch.empty(param.shape, dtype=kind, device=device)
            param = nn.Parameter(empty, requires_grad=param.requires_grad)
        register(self, name, param)

    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        nn.Module.register_parameter = register_empty  # type: ignore[method-assign]
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        for cls, method in saved.items():
            cls.reset_parameters = method  # type: ignore[method-assign]


@dataclass(frozen=True)
class _TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code: F32, BF16, I64, ...


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
) -> LoopedCausalLM:
    """The model of `model_dir`, in eval mode, without gradients, on `device` in `dtype`.
    `max_model_len`: the context it runs with, at most its config's max_position_embeddings
    (which sizes nothing but tables: no learned positions, no RoPE scaling)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}"
        )
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    if max_model_len is not None:
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context of "
                f"{cfg.max_position_embeddings} positions (max_position_embeddings in "
                f"{model_dir / 'config.json'})"
            )
        cfg = replace(cfg, max_position_embeddings=max_model_len)
    device = torch.device(device)
    if load_format != "dummy":
        # Read every file header (a truncated or garbage file fails here) before allocating.
        infos = _checkpoint_infos(model_dir)
    with _empty_parameters(dtype, device):
        model: LoopedCausalLM = model_class(cfg.model_type)(cfg)
    model.to(device=device, dtype=dtype)  # buffers (rotary inv_freq stays fp32: it recomputes)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        _validate(infos, _expected_shapes(model), model_dir)  # names, shapes, dtypes
        _fill(model, infos)
    return model.eval().requires_grad_(False)


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill an allocated model in place from the safetensors of `model_dir` (strict)."""
    infos = _checkpoint_infos(Path(model_dir))
    _validate(infos, _expected_shapes(model), Path(model_dir))
    _fill(model, infos)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Deterministic random weights: linear/embedding N(0, 0.02), norms one, biases zero."""
    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            weight = module.weight
            if weight.device not in generators:
                # One generator per device, seeded once: sampling happens where the weight lives.
                generators[weight.device] = torch.Generator(weight.device).manual_seed(seed)
            weight.normal_(0.0, 0.02, generator=generators[weight.device])
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


def save_checkpoint(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write weights in HF layout: one `model.safetensors`, or `model-0000i-of-0000n` shards and
    an index when they exceed `max_shard_bytes`. Replaces any checkpoint already in `out_dir`."""
    state = model_or_state_dict
    if isinstance(state, nn.Module):
        state = state.state_dict()
    tensors = {name: _storable(t) for name, t in state.items()}
    shards = _split(tensors, max_shard_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_PATTERN.fullmatch(old.name):
            old.unlink()
    if len(shards) == 1:
        save_file(shards[0], out / SINGLE_FILE, metadata={"format": "pt"})
        return [out / SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*(out / n for n in names), out / INDEX_FILE]


def _storable(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    # A view into a larger storage would be rejected by safetensors (or save the whole storage).
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _split(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _weight_files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read and, for a sharded checkpoint, its weight map."""
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE], None
    index_path = model_dir / INDEX_FILE
    if not index_path.is_file():
        raise CheckpointError(
            f"no safetensors weights in {model_dir} (expected {SINGLE_FILE} or {INDEX_FILE}); "
            "fetch them with `rlt download`, or use load_format='dummy' for random weights"
        )
    try:
        weight_map = dict(json.loads(index_path.read_text())["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{index_path} is not a valid safetensors index: {exc}") from None
    files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    for file in files:
        if not file.is_file():
            raise CheckpointError(
                f"shard {file.name} listed in {INDEX_FILE} is missing from {model_dir}"
            )
    return files, weight_map


def _checkpoint_infos(model_dir: Path) -> dict[str, _TensorInfo]:
    """Header facts of every tensor, after checking the index against the shards' contents."""
    files, weight_map = _weight_files(model_dir)
    infos: dict[str, _TensorInfo] = {}
    for file in files:
        with _reading(file), safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name in infos:
                    raise CheckpointError(
                        f"tensor {name!r} is stored in both {infos[name].file.name} and {file.name}"
                    )
                sl = f.get_slice(name)
                infos[name] = _TensorInfo(file, tuple(sl.get_shape()), sl.get_dtype())
    if weight_map is not None:
        _check_index(weight_map, infos)
    return infos


def _check_index(weight_map: dict[str, str], infos: dict[str, _TensorInfo]) -> None:
    for name, shard in weight_map.items():
        if name not in infos:
            raise CheckpointError(
                f"tensor {name!r} is listed in {INDEX_FILE} under {shard} but no shard holds it"
            )
        if infos[name].file.name != shard:
            raise CheckpointError(
                f"tensor {name!r}: {INDEX_FILE} points to {shard} "
                f"but it is stored in {infos[name].file.name}"
            )
    for name, info in infos.items():
        if name not in weight_map:
            raise CheckpointError(
                f"tensor {name!r} in {info.file.name} is not listed in {INDEX_FILE}"
            )


def _expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    # state_dict excludes non-persistent buffers (rotary inv_freq): they are derived, not loaded.
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _validate(
    infos: dict[str, _TensorInfo], expected: dict[str, tuple[int, ...]], model_dir: Path
) -> None:
    found = {n for n in infos if not n.endswith(_IGNORED_SUFFIX)}
    missing = [n for n in expected if n not in found]
    if missing:
        raise CheckpointError(
            f"checkpoint {model_dir} lacks {len(missing)} tensor(s): {_names(missing)}"
        )
    unexpected = [n for n in found if n not in expected]
    if unexpected:
        raise CheckpointError(
            f"checkpoint {model_dir} has {len(unexpected)} unexpected tensor(s): "
            f"{_names(unexpected)}"
        )
    for name, shape in expected.items():
        info = infos[name]
        if info.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} in {info.file.name} has dtype {info.dtype}; "
                f"expected one of {', '.join(sorted(_FLOAT_DTYPES))}"
            )
        if info.shape != shape:
            raise CheckpointError(
                f"tensor {name!r} in {info.file.name}: "
                f"expected shape {list(shape)}, found {list(info.shape)}"
            )


@torch.no_grad()
def _fill(model: nn.Module, infos: dict[str, _TensorInfo]) -> None:
    targets = model.state_dict(keep_vars=True)
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(infos[name].file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                # One tensor at a time; copy_ converts dtype and moves it to the target device.
                with _reading(file, name):
                    targets[name].copy_(f.get_tensor(name))


@contextmanager
def _reading(file: Path, tensor: str | None = None) -> Iterator[None]:
    """safetensors' own errors (a truncated file, a garbage header, an unreadable tensor) as one
    CheckpointError line naming the file (and the tensor)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        if not _is_safetensors_error(exc):
            raise
        what = f"tensor {tensor!r} in {file}" if tensor else str(file)
        raise CheckpointError(
            f"{what} is not a readable safetensors file ({_one_line(exc)}); "
            "it may be truncated or damaged: download it again"
        ) from None


def _is_safetensors_error(exc: BaseException) -> bool:
    # safetensors raises SafetensorError (a plain Exception subclass), OSError or ValueError.
    return type(exc).__name__ == "SafetensorError" or isinstance(exc, (OSError, ValueError))


def _one_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = text.removeprefix("Error while deserializing header: ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
