"""Programmatic dependent launch for the decode step's small kernels (rollout/kernels/pdl.py):
each kernel, built ahead of time for sm_90 by Triton's own ptxas (no GPU), waits for the
kernel before it before its first read when launched with PDL, and has no wait without it;
HANDOFF_PDL unset, nothing launches with it."""

import pytest

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from handoff.rollout.kernels import fused, paged_decode  # noqa: E402
from handoff.rollout.kernels.pdl import pdl_on  # noqa: E402

F32, I32, I64 = "*fp32", "*i32", "*i64"
ATTENTION = {"NUM_Q_HEADS": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128}
TERM = {"RANK": 16, "RANK_PAD": 16, "ROWS": 16}
KERNELS = {   # kernel: (pointer and scalar types other than *bf16 / i32, constexprs)
    "add_rms_norm": (fused._add_rms_norm_kernel, {"eps": "fp32"},
                     {"HAS_RESIDUAL": True, "BLOCK": 2048}),
    "silu_mul": (fused._silu_mul_kernel, {}, {"BLOCK": 1024}),
    "qk_norm_rope_store": (
        fused._qk_norm_rope_store_kernel,
        {"pos_ptr": I64, "table_ptr": F32, "slot_ptr": I64, "k_scale_ptr": F32,
         "v_scale_ptr": F32, "eps": "fp32"},
        {"NUM_HEADS": 16, "NUM_KV_HEADS": 8, "HEADS_PAD": 16, "KV_HEADS_PAD": 8,
         "HEAD_DIM": 128, "HALF": 64, "HALF_PAD": 64, "HAS_NORM": True, "STORE": True,
         "HAS_SCALES": False}),
    "paged_decode": (
        paged_decode._paged_decode_kernel,
        {"qk_scale_log2": "fp32", "bt_ptr": I32, "ctx_ptr": I32, "order_ptr": I32,
         "k_scale_ptr": F32, "v_scale_ptr": F32, "part_o_ptr": F32, "part_lse_ptr": F32},
        {**ATTENTION, "GROUP": 2, "GROUP_PAD": 16, "BLOCK_SIZE": 16, "TILE": 64,
         "SPLIT": True, "HAS_SCALES": False, "HAS_ORDER": True}),
    "merge_splits": (paged_decode._merge_splits_kernel,
                     {"part_o_ptr": F32, "part_lse_ptr": F32}, {**ATTENTION, "SPLITS_PAD": 8}),
    # with a LoRA adapter: its term added by the reader, or alone
    "silu_mul_term": (fused._silu_mul_term_kernel, {}, {**TERM, "BLOCK": 128}),
    "add_term": (fused._add_term_kernel, {}, {**TERM, "BLOCK": 64}),
    "qk_norm_rope_store_term": (
        fused._qk_norm_rope_store_term_kernel,
        {"pos_ptr": I64, "table_ptr": F32, "slot_ptr": I64, "k_scale_ptr": F32,
         "v_scale_ptr": F32, "eps": "fp32"},
        {**TERM, "NUM_HEADS": 16, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HALF": 64,
         "HALF_PAD": 64, "HAS_NORM": True, "STORE": True, "HAS_SCALES": False}),
}


def _ptx(fn, types: dict, constexprs: dict, pdl: bool) -> list[str]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: "constexpr" if n in constexprs or n == "PDL"
                 else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
                 for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs={**constexprs, "PDL": pdl})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "launch_pdl": pdl})
    assert kernel.metadata.launch_pdl == pdl
    return kernel.asm["ptx"].splitlines()


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_under_pdl_a_kernel_waits_before_its_first_read(name):
    fn, types, constexprs = KERNELS[name]
    lines = _ptx(fn, types, constexprs, pdl=True)
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    reads = [i for i, line in enumerate(lines) if "ld.global" in line or "cp.async" in line]
    assert len(waits) == 1 and reads and waits[0] < min(reads)
    plain = _ptx(fn, types, constexprs, pdl=False)
    assert not any("griddepcontrol" in line for line in plain)


def test_pdl_is_off_unless_asked_for_and_never_on_the_cpu(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("HANDOFF_PDL", raising=False)
    assert not pdl_on(cpu)
    monkeypatch.setenv("HANDOFF_PDL", "1")
    assert not pdl_on(cpu)
