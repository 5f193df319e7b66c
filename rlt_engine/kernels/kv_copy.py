"""LAST_EXITED exit copies of a decode traversal in one launch.

A token that exits after loop e lends its K/V (every layer) to each deeper plane, so later
queries at loop d read version min(d, e). `exit_copies_(k, v, exits, loop, block, offset, src,
tables, block_size)`: for each row that exits (`exits`), at every layer, the K/V at slot
`src[row]` (where the row wrote them this traversal, in the plane of its loop) also goes to the
same position in each plane p > loop[row]: slot tables[row, p, block[row]] * block_size +
offset[row]. The pools are [layers, slots, kv_heads, head_dim]; tables [rows, planes, width].

One program per (row, layer); rows that do not exit, and exits with no deeper plane, move no
byte. The previous path sent every pair that is not wanted to the trash slot, so the whole
batch's K/V was read and ~(depth - 1) x rows x layers rows written into one slot, after ~6
torch launches computing the destinations: replacing it took adaptive exit's share of the
loop savings from 82% to 87% at c=8 and 73% to 79% at c=64 on the H200
(benchmarks/results/2026-12-02-exit-copies-h200.md). `exit_copies_reference` is the torch
form (the torch backend's). Capturable (no host sync); launched with PDL where available.
triton is imported lazily (see paged_attention).
"""

from __future__ import annotations

import torch

from rlt_engine.kernels import paged_attention as _pa
from rlt_engine.kernels import pdl as _pdl
from rlt_engine.kernels.paged_attention import supported

__all__ = ["exit_copies_", "exit_copies_reference", "supported"]

triton = tl = None  # set by _import_triton(); the kernel's body reads the module global `tl`


def exit_copies_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    exits: torch.Tensor,
    loop: torch.Tensor,
    block: torch.Tensor,
    offset: torch.Tensor,
    src: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
) -> None:
    """The torch semantics of `exit_copies_` (any device, capturable): pairs that are not
    wanted copy the row's own slot onto itself, which changes nothing."""
    b, planes = tables.shape[0], tables.shape[1]
    if b == 0 or planes < 2:
        return
    deeper = torch.arange(1, planes, device=loop.device)
    own = tables[:, 1:].gather(2, block[:, None, None].expand(b, planes - 1, 1))[:, :, 0]
    dst_own = own.long() * block_size + offset[:, None]
    wanted = exits[:, None] & (deeper[None, :] > loop[:, None])
    dst = torch.where(wanted, dst_own, src[:, None]).flatten()
    pairs = src[:, None].expand(b, planes - 1).flatten()
    k.index_copy_(1, dst, k.index_select(1, pairs))
    v.index_copy_(1, dst, v.index_select(1, pairs))


def exit_copies_(
    k: torch.Tensor,
    v: torch.Tensor,
    exits: torch.Tensor,
    loop: torch.Tensor,
    block: torch.Tensor,
    offset: torch.Tensor,
    src: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
) -> None:
    """See the module docstring. exits bool [b]; loop, block, offset, src int64 [b]; tables
    int32 [b, planes, width] with unit stride in width."""
    if k.shape != v.shape or k.dim() != 4 or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("k and v must be contiguous [layers, slots, kv_heads, head_dim] pools")
    b, planes = tables.shape[0], tables.shape[1]
    if tables.dim() != 3 or tables.stride(2) != 1:
        raise ValueError("tables must be [rows, planes, width] with unit stride in width")
    if any(t.shape != (b,) for t in (exits, loop, block, offset, src)):
        raise ValueError(f"exits, loop, block, offset and src must be [{b}] (one per row)")
    if b == 0 or planes < 2:
        return
    ok, why = supported(k.device)
    if not ok:
        raise RuntimeError(f"Triton exit_copies_ cannot run on {k.device}: {why}")
    _import_triton()
    layers, slots = k.shape[0], k.shape[1]
    width = k.shape[2] * k.shape[3]
    pdl = _pdl.enabled(k.device)
    kernel = _pa._kernel(_exit_copies_kernel, _pa._interpreter_mode())
    with _pa._on_device(k.device):
        kernel[(b, layers)](
            k,
            v,
            exits,
            loop,
            block,
            offset,
            src,
            tables,
            slots,
            tables.stride(0),
            tables.stride(1),
            block_size,
            PLANES=planes,
            WIDTH=width,
            BLOCK=triton.next_power_of_2(width),
            PDL=pdl,
            num_warps=4,
            **_pdl.launch_options(pdl),
        )


def _import_triton() -> None:
    global triton, tl
    triton, tl = _pa.require_triton()


def _exit_copies_kernel(
    k_ptr,
    v_ptr,
    exits_ptr,
    loop_ptr,
    block_ptr,
    offset_ptr,
    src_ptr,
    tables_ptr,
    num_slots,
    table_row_stride,
    table_plane_stride,
    block_size,
    PLANES: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row, layer = tl.program_id(0), tl.program_id(1)
    if PDL:  # wait for the previous kernel, then release the next (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    exits = tl.load(exits_ptr + row) != 0
    loop = tl.load(loop_ptr + row)
    offs = tl.arange(0, BLOCK)
    # a row that stays, or exits at the deepest plane, reads and writes nothing
    copy = (offs < WIDTH) & exits & (loop < PLANES - 1)
    base = layer.to(tl.int64) * num_slots * WIDTH  # 64-bit offsets: the pool exceeds 2**31
    src = tl.load(src_ptr + row)
    k = tl.load(k_ptr + base + src * WIDTH + offs, mask=copy)
    v = tl.load(v_ptr + base + src * WIDTH + offs, mask=copy)
    at = tl.load(block_ptr + row)
    offset = tl.load(offset_ptr + row)
    table = tables_ptr + row.to(tl.int64) * table_row_stride + at
    for plane in tl.static_range(1, PLANES):
        wanted = exits & (plane > loop)
        dst = tl.load(table + plane * table_plane_stride, mask=wanted, other=0).to(tl.int64)
        dst = dst * block_size + offset
        tl.store(k_ptr + base + dst * WIDTH + offs, k, mask=copy & wanted)
        tl.store(v_ptr + base + dst * WIDTH + offs, v, mask=copy & wanted)
