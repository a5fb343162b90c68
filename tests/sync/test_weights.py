import pytest
import torch

from handoff.errors import HandoffError
from handoff.sync.weights import checksum, kept_bytes, sync_weights


def iter_state_dict(state, dtype=None):
    """(name, tensor) pairs from a plain state dict, cast to `dtype`: a trainer stand-in."""
    for name, t in state.items():
        yield name, (t.to(dtype) if dtype is not None else t)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(16, 8 + i, generator=g) for i in range(6)} | {
        "big": torch.randn(64, 64, generator=g)}


class Receiver:
    """Stands in for an engine: copies out of the bucket views into its own storage."""

    def __init__(self, corrupt: str | None = None):
        self.store: dict[str, torch.Tensor] = {}
        self.calls: list[list[str]] = []
        self.corrupt = corrupt

    def load_weights(self, weights):
        names = []
        for name, t in weights:
            self.store[name] = t.clone()
            if name == self.corrupt:
                self.store[name].view(-1)[0] += 1
            names.append(name)
        self.calls.append(names)


def test_every_tensor_arrives_exactly_in_buckets():
    state = _state()
    rx = Receiver()
    stats = sync_weights(iter_state_dict(state), rx.load_weights, bucket_bytes=2048, device="cpu",
                         readback=rx.store.__getitem__)
    assert set(rx.store) == set(state)
    for k, v in state.items():
        assert torch.equal(rx.store[k], v)
    assert stats.num_tensors == len(state)
    assert stats.bytes == sum(v.numel() * 4 for v in state.values())
    # 'big' (16 KiB) exceeds the 2 KiB bucket and travels alone; the small ones share buckets.
    assert ["big"] in rx.calls
    assert stats.num_buckets == len(rx.calls) < len(state)
    assert stats.verified_buckets == stats.num_buckets
    assert stats.bound_extra_bytes == 2 * 2048 + 64 * 64 * 4


def test_bucket_reuse_does_not_clobber_earlier_tensors():
    # Receiver keeps views only if it forgets to copy; ours copies, so later buckets must not
    # change what was delivered earlier.
    state = _state(1)
    rx = Receiver()
    sync_weights(iter_state_dict(state), rx.load_weights, bucket_bytes=1024, device="cpu")
    for k, v in state.items():
        assert torch.equal(rx.store[k], v)


def test_checksum_mismatch_is_caught():
    state = _state(2)
    rx = Receiver(corrupt="layers.3.w")
    with pytest.raises(HandoffError, match="checksum mismatch"):
        sync_weights(iter_state_dict(state), rx.load_weights, bucket_bytes=4096, device="cpu",
                     readback=rx.store.__getitem__)


def test_checksum_is_order_and_value_sensitive():
    a = torch.arange(10, dtype=torch.float32)
    assert checksum(a) == checksum(a.clone())
    assert checksum(a) != checksum(a.flip(0))
    b = a.clone()
    b[3] = 3.0000002
    assert checksum(a) != checksum(b)


def test_dtype_cast_and_bad_bucket():
    state = _state(3)
    rx = Receiver()
    sync_weights(iter_state_dict(state, torch.bfloat16), rx.load_weights, bucket_bytes=4096,
                 device="cpu")
    assert all(t.dtype == torch.bfloat16 for t in rx.store.values())
    with pytest.raises(HandoffError, match="bucket_mb"):
        sync_weights(iter_state_dict(state), rx.load_weights, bucket_bytes=0, device="cpu")


def test_kept_bytes_counts_what_select_keeps_from_the_shapes_alone():
    """A TP-2 rank's rule: rows split in half, 1-D tensors (norms) replicated."""
    state = _state() | {"norm": torch.randn(64)}

    def half_rows(name, full):
        return full if full.dim() == 1 else full.narrow(0, 0, full.shape[0] // 2)

    shapes = [(name, t.shape) for name, t in state.items()]
    kept = sum(half_rows(n, t.to(torch.bfloat16)).nbytes for n, t in state.items())
    assert kept_bytes(shapes, torch.bfloat16, half_rows) == kept
    assert kept < sum(t.numel() * 2 for t in state.values())
