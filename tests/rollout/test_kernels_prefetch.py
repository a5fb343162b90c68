"""The L2 prefetch kernel (rollout/kernels/prefetch.py): built ahead of time for sm_90 by
Triton's own ptxas (no GPU), so the inline PTX assembles, and every thread's prefetch is
guarded by its chunk's bound and kept though nothing reads its result."""

import pytest


def _build(per_program: int, chunk: int):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from handoff.rollout.kernels.prefetch import _prefetch_kernel

    signature = {"base_ptr": "*u8", "n_chunks": "i32", "CHUNK": "constexpr",
                 "PER_PROGRAM": "constexpr"}
    src = ASTSource(fn=_prefetch_kernel, signature=signature,
                    attrs={(0,): [["tt.divisibility", 16]]},
                    constexprs={"CHUNK": chunk, "PER_PROGRAM": per_program})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def test_the_bulk_prefetch_builds_for_hopper_guarded_by_each_chunks_bound():
    from handoff.rollout.kernels.prefetch import _PER_PROGRAM, CHUNK

    kernel = _build(_PER_PROGRAM, CHUNK)
    lines = [line for line in kernel.asm["ptx"].splitlines()
             if "cp.async.bulk.prefetch.L2.global" in line]
    assert len(lines) == 1 and f"], {CHUNK};" in lines[0]
    assert "@p cp.async" in lines[0] and "setp.ne.b32 p" in lines[0]
    assert kernel.metadata.shared == 0   # nothing staged: the TMA unit fills L2 itself


def test_not_on_a_cpu_device():
    torch = pytest.importorskip("torch")
    from handoff.rollout.kernels.pdl import hopper

    assert not hopper(torch.device("cpu"))


def test_a_plan_is_read_from_its_name_and_a_bad_part_named_with_the_fix():
    pytest.importorskip("triton")
    from handoff.errors import HandoffError
    from handoff.rollout.kernels.prefetch import MB, parse_plan

    assert parse_plan("o+gu16") == {"o": True, "gu": 16 * MB, "qkv": 0}
    assert parse_plan("qkv8") == {"o": False, "gu": 0, "qkv": 8 * MB}
    with pytest.raises(HandoffError, match=r"'gu'.*e\.g\. o\+gu16"):
        parse_plan("o+gu")


def test_each_layer_asks_for_its_o_its_gate_up_head_and_the_next_layers_qkv():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from handoff.rollout.kernels.prefetch import MB, LayerPrefetch, parse_plan

    layers = [tuple(torch.zeros(4) for _ in range(3)) for _ in range(3)]   # o, gate_up, qkv
    asks = LayerPrefetch(layers, parse_plan("o+gu16+qkv8"), stream=None)._asks
    for i, layer_asks in enumerate(asks):
        o, gate_up, _ = layers[i]
        wanted = [(o, None), (gate_up, 16 * MB)]
        if i + 1 < len(layers):
            wanted.append((layers[i + 1][2], 8 * MB))
        assert [(id(t), n) for t, n in layer_asks] == [(id(t), n) for t, n in wanted]
    assert LayerPrefetch(layers, parse_plan(""), stream=None)._asks == [[], [], []]
