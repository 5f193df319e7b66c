"""The models' fast path (packed weights, fused Triton norm and RoPE; interpreted on the CPU)
computes the same function as the plain torch path."""

from __future__ import annotations

import golden
import torch

from rlt_engine.checkpoints.loader import load_model
from rlt_engine.oracle.contiguous_kv import ContiguousKVCache, ContiguousMetadata


def _loops(model, ids: list[int], hazards: list | None = None) -> torch.Tensor:
    dtype = model.lm_head.weight.dtype
    cache = ContiguousKVCache(model.config, 1, len(ids), dtype=dtype)
    positions = torch.arange(len(ids))
    hidden = model.prelude(torch.tensor(ids))
    states = []
    for loop in range(model.num_loops):
        meta = ContiguousMetadata(
            positions=positions,
            loop_indices=torch.full_like(positions, loop),
            seq_ids=torch.zeros_like(positions),
        )
        out = model.recurrent(hidden, meta, cache)
        hidden = out.hidden
        states.append(model.coda(hidden))
        if hazards is not None:
            hazards.append(out.hazard)
    return torch.stack(states)


@torch.inference_mode()
def test_fast_path_matches_the_torch_path_and_keeps_parameter_names():
    plain = load_model(golden.GOLDEN_DIR, dtype=torch.float32, device="cpu")
    fast = load_model(golden.GOLDEN_DIR, dtype=torch.float32, device="cpu")
    names = sorted(fast.state_dict())
    fast.use_fast_path()
    fast.use_fast_path()  # idempotent
    assert sorted(fast.state_dict()) == names
    for name, tensor in plain.state_dict().items():
        assert torch.equal(fast.state_dict()[name], tensor), name
    for ids in golden.prompts():
        want, got = _loops(plain, ids), _loops(fast, ids)
        # measured: 1.9e-5 after four loops on logits up to 11.6 (the fused norm sums in
        # another order, the packed GEMM may block differently); a wrong kernel is O(1) off
        torch.testing.assert_close(got, want, atol=5e-5, rtol=0)
        assert torch.equal(got[-1, -1].argmax(), want[-1, -1].argmax())


def _tiny(kind: str, root) -> object:
    import tiny_checkpoints

    if kind == "ouro":
        return tiny_checkpoints.write_tiny_ouro(root / kind, tokenizer_from=None)
    if kind == "ouro-no-final-norm":
        return tiny_checkpoints.write_tiny_ouro(
            root / kind, tokenizer_from=None, skip_loop_final_norm=True
        )
    return tiny_checkpoints.write_tiny_nanbeige(root / kind)


@torch.inference_mode()
def test_chained_norms_bit_identical_to_the_layer_loop(tmp_path):
    """The fast path's chained layer loop (each residual add with the next norm in one launch,
    kernels/norm_chain) equals the fast path's plain layer loop bit for bit, fp32 and bf16,
    for Ouro (sandwich norms; with and without the final norm every loop) and Nanbeige; the
    exit hazard its last launch computes is within a few ulps of the torch gate's."""
    ids = [3, 17, 9, 30, 2, 11]
    for kind in ("ouro", "ouro-no-final-norm", "nanbeige"):
        path = _tiny(kind, tmp_path)
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(path, dtype=dtype, device="cpu")
            model.use_fast_path()
            assert model.chained_norms
            fused, torch_gate = [], []
            chained = _loops(model, ids, fused)
            model.chained_norms = False
            plain = _loops(model, ids, torch_gate)
            assert torch.equal(chained, plain), (kind, dtype)
            for got, want in zip(fused, torch_gate, strict=True):
                if want is None:  # no exit gate (Nanbeige)
                    assert got is None
                else:  # the last add + norm launch's hazard: a few ulps from torch's gate
                    torch.testing.assert_close(got, want, atol=1e-6, rtol=4e-7)
