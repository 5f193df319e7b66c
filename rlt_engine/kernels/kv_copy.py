"""Copy K/V slots across every layer in one launch (LAST_EXITED exit copies).

`copy_slots_(k, v, src, dst)`: for each pair i, k[:, dst[i]] = k[:, src[i]] and the same for v,
over every layer. The pool is [layers, slots, kv_heads, head_dim]; torch's advanced indexing on
dim 1 launches several kernels per call, this is one program per (pair, layer). `src` and `dst`
must be disjoint (exit copies go from one plane's blocks to other planes'); pairs whose `dst`
repeat (the trash slot of idle rows) race only among themselves. Capturable (no host
sync). triton is imported lazily (see paged_attention).
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels.paged_attention import supported

__all__ = ["copy_slots_", "supported"]

triton = tl = None  # set by _import_triton(); the kernel's body reads the module global `tl`


def copy_slots_(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    if k.shape != v.shape or k.dim() != 4 or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("k and v must be contiguous [layers, slots, kv_heads, head_dim] pools")
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError("src and dst must be 1-D index tensors of one length")
    pairs = src.shape[0]
    if pairs == 0:
        return
    ok, why = supported(k.device)
    if not ok:
        raise RuntimeError(f"Triton copy_slots_ cannot run on {k.device}: {why}")
    _import_triton()
    layers, slots = k.shape[0], k.shape[1]
    width = k.shape[2] * k.shape[3]
    kernel = _pa._kernel(_copy_slots_kernel, _pa._interpreter_mode())
    with _pa._on_device(k.device):
        kernel[(pairs, layers)](
            k,
            v,
            # the kernel reads pair i at offset i: an expanded view (stride 0, e.g. one row's
            # source repeated for each deeper plane) must be materialised first
            src.to(torch.int64).contiguous(),
            dst.to(torch.int64).contiguous(),
            slots,
            WIDTH=width,
            BLOCK=triton.next_power_of_2(width),
        )


def _import_triton() -> None:
    global triton, tl
    triton, tl = _pa.require_triton()


def _copy_slots_kernel(
    k_ptr, v_ptr, src_ptr, dst_ptr, num_slots, WIDTH: tl.constexpr, BLOCK: tl.constexpr
):
    pair, layer = tl.program_id(0), tl.program_id(1)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    base = layer.to(tl.int64) * num_slots * WIDTH  # 64-bit offsets: the pool exceeds 2**31
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    k = tl.load(k_ptr + base + src * WIDTH + offs, mask=mask)
    v = tl.load(v_ptr + base + src * WIDTH + offs, mask=mask)
    tl.store(k_ptr + base + dst * WIDTH + offs, k, mask=mask)
    tl.store(v_ptr + base + dst * WIDTH + offs, v, mask=mask)
