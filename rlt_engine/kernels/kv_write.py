"""Write a traversal's K and V rows into one layer of the paged pool in one Triton launch.

`write_kv_(k_pool, v_pool, k, v, slot_mapping)`: k_pool[slot_mapping[r]] = k[r] and the same
for v, for every row r. torch's advanced-index assignment launches one kernel per tensor (and
copies a non-contiguous view first); here a program per row moves both, reading k and v where
they lie (views of the packed qkv projection output). Pure copies: exact in every dtype. Rows
mapped to the trash slot race only among themselves (never read). Capturable.
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels.paged_attention import supported

__all__ = ["supported", "write_kv_"]

triton = tl = None  # set by _import_triton(); the kernel's body reads the module global `tl`


def write_kv_(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_pool/v_pool: [slots, kv_heads, head_dim], contiguous; k/v: [rows, kv_heads, head_dim]
    with each row's heads contiguous (any row stride); slot_mapping: [rows] int64."""
    if k_pool.shape != v_pool.shape or k_pool.dim() != 3:
        raise ValueError("k_pool and v_pool must be [slots, kv_heads, head_dim] of one shape")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("k_pool and v_pool must be contiguous")
    rows = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != k_pool.shape[1:] or slot_mapping.shape != (rows,):
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} "
            f"do not fit a pool of rows {tuple(k_pool.shape[1:])}"
        )
    if k.dtype != k_pool.dtype or v.dtype != v_pool.dtype:
        raise ValueError("k and v must have the pool's dtype")
    width = k.shape[1] * k.shape[2]
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    if rows == 0 or width == 0:
        return
    ok, why = supported(k_pool.device)
    if not ok:
        raise RuntimeError(f"Triton write_kv_ cannot run on {k_pool.device}: {why}")
    _import_triton()
    kernel = _pa._kernel(_write_kv_kernel, _pa._interpreter_mode())
    with _pa._on_device(k_pool.device):
        kernel[(rows,)](
            k_pool,
            v_pool,
            k,
            v,
            slot_mapping.to(torch.int64).contiguous(),  # read as row i at offset i
            k.stride(0),
            v.stride(0),
            WIDTH=width,
            BLOCK=triton.next_power_of_2(width),
        )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when each row's [kv_heads, head_dim] is one contiguous run, else a copy."""
    if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


def _import_triton() -> None:
    global triton, tl
    triton, tl = _pa.require_triton()


def _write_kv_kernel(
    k_pool_ptr,
    v_pool_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    stride_k,
    stride_v,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row)  # int64: the pool exceeds 2**31 elements
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    k = tl.load(k_ptr + row * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + row * stride_v + offs, mask=mask)
    tl.store(k_pool_ptr + slot * WIDTH + offs, k, mask=mask)
    tl.store(v_pool_ptr + slot * WIDTH + offs, v, mask=mask)
