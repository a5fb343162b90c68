"""Processes and devices: which device this process drives, its process group, the mesh,
reductions over ranks, and the end of a torchrun launch. One place for all of it.

    device = resolve_device("auto")          # cuda -> this process's LOCAL_RANK, or cpu
    init_process_group(device)               # torchrun's ranks (env://), or a 1-process group
    mesh = init_mesh(device)                 # the trainer's 1-D FSDP mesh over every rank
    rank, world = world_rank_size()
    mean, std, n = mean_over_ranks(values)
    end_distributed_run()                    # after the outputs are written
    says_error(error)                        # whether this rank prints a one-line error

A process group that already exists is reused as it is. The engine's tensor-parallel groups
are subgroups of this one (rollout/parallel.py).

Torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are taken as a
launch only when they are complete and consistent; anything else is refused in one line
(`launch_env`), never guessed at: a WORLD_SIZE=2 left in a lone process's environment would
otherwise make it take half of every batch, and a RANK without WORLD_SIZE a world of one
that believes it is rank 3. A process without any of RANK, WORLD_SIZE, LOCAL_RANK is a
world of one (MASTER_ADDR/PORT alone are often exported by a cluster's shell: ignored), as
is one whose partial set says so itself (WORLD_SIZE=1, with RANK and LOCAL_RANK 0 if set).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from handoff.errors import HandoffError, RankError

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_NEEDED_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(name: str, lo: int, hi: int | None, unset: str) -> int:
    raw = os.environ[name]
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < lo or (hi is not None and value >= hi):
        span = f"{lo}..{hi - 1}" if hi is not None else f"a whole number >= {lo}"
        raise HandoffError(f"{name}={raw!r} is not {span}: it is torchrun's variable; launch "
                           f"with `torchrun --nproc-per-node N -m handoff ...`, or {unset}")
    return value


def launch_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) of a torchrun launch, None for a lone process, or one
    line when torchrun's variables are partial or not numbers in range."""
    present = [name for name in _LAUNCH_VARS if name in os.environ]
    if not present:
        return None
    missing = [name for name in _NEEDED_VARS if name not in os.environ]
    if missing and _says_one_process(present):
        return None
    unset = "unset " + " ".join(n for n in (*_LAUNCH_VARS, "MASTER_ADDR", "MASTER_PORT")
                                if n in os.environ) + " to run one process"
    if missing:
        raise HandoffError(f"{present[0]}={os.environ[present[0]]} is set but "
                           f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                           "these are torchrun's variables; launch with `torchrun "
                           f"--nproc-per-node N -m handoff ...`, or {unset}")
    world = _env_int("WORLD_SIZE", 1, None, unset)
    rank = _env_int("RANK", 0, world, unset)
    local = _env_int("LOCAL_RANK", 0, world, unset) if "LOCAL_RANK" in os.environ else 0
    return rank, world, local


def _says_one_process(present: list[str]) -> bool:
    """WORLD_SIZE=1, and RANK / LOCAL_RANK 0 where set: a partial set that cannot mislead
    (one process takes every prompt either way)."""
    values = {name: os.environ[name].strip() for name in present}
    return (values.get("WORLD_SIZE") == "1"
            and all(values.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK")))


def resolve_device(device: str | torch.device) -> torch.device:
    """'cpu' | 'cuda' | 'cuda:1' | 'auto' -> a concrete device (cuda -> this process's LOCAL_RANK),
    made the current CUDA device."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError:
        raise HandoffError(f"device {str(device)!r} is not a device name: use cpu or cuda") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise HandoffError("device 'cuda' was asked for but torch sees no GPU: "
                               "run on the CPU (run.device=cpu in a config; --device cpu for "
                               "the bench and generate commands)")
        if device.index is None:
            local = (launch_env() or (0, 1, 0))[2]
            if local >= torch.cuda.device_count():
                raise RankError(f"LOCAL_RANK={local} but torch sees "
                                f"{torch.cuda.device_count()} GPU(s): start at most that many "
                                "processes per node (torchrun --nproc-per-node), or unset "
                                "LOCAL_RANK")
            device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise HandoffError(f"device {str(device)!r} is not supported: use cpu or cuda")
    return device


def with_index(device: torch.device | str) -> torch.device:
    """`device` with its index filled in: 'cuda' is the current CUDA device (no other change)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def wait_for_compute(device: torch.device) -> None:
    """Block until the current stream's work is done; copies on other streams run on."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class ComputeGap:
    """How long the current stream sits idle across a stretch of host work, from its start
    to `close()`: on CUDA two timing events on the stream (the second completes right after
    the first when work queued before the stretch outlasts it: a gap of 0); on CPU the
    host's time (the device is the host). Read `seconds()` once the stream has drained."""

    def __init__(self, device: torch.device):
        self.device = device
        self._start, self._end = self._mark(), None

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def close(self) -> None:
        self._end = self._mark()

    def seconds(self) -> float:
        if self.device.type == "cuda":
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start


def wait_for_device(device: torch.device) -> None:
    """Block until every stream of the device is idle."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init_process_group(device: torch.device) -> None:
    """Join the torchrun group (env://), or make a 1-process group when launched alone."""
    if dist.is_initialized():
        return
    # With a GPU present the group gets NCCL too, even when a CPU model creates it first: a
    # CUDA model in the same process (tests, benches) then finds the backend it needs.
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    launch = launch_env()
    if launch is not None:
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            # Not torchrun's (a launcher of one's own, or variables left in a shell): the
            # rendezvous waits up to 30 minutes for ranks that may never come, so say so.
            print(f"rank {launch[0]} of {launch[1]}: waiting for the other ranks at "
                  f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} (WORLD_SIZE, RANK, "
                  "MASTER_ADDR and MASTER_PORT are set, torchrun did not set them: unset them "
                  "to run one process)", file=sys.stderr, flush=True)
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def init_mesh(device: str | torch.device) -> DeviceMesh:
    """The 1-D mesh over every process of the default group, on `device`'s type."""
    dev = resolve_device(device)
    init_process_group(dev)
    return init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))


def world_rank_size() -> tuple[int, int]:
    """(rank, world size) of the default group, or of torchrun's environment before it exists."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world, _ = launch_env() or (0, 1, 0)
    return rank, world


def check_world_size(gpus: int) -> None:
    """Refuse a run whose parallel.gpus is not the number of processes started."""
    world = world_rank_size()[1]
    if world != gpus:
        raise HandoffError(f"parallel.gpus={gpus} but {world} process(es) were started: launch "
                           f"`torchrun --nproc-per-node {gpus} -m handoff train ...`, or set "
                           f"parallel.gpus={world}")


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the default group (nothing to do at world size 1)."""
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast from rank `src` over the default group (nothing at world size 1)."""
    if dist.get_world_size() > 1:
        dist.broadcast(t, src=src)
    return t


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank `src`'s `obj` on every rank (picklable; nothing to do at world size 1)."""
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=src)
    return box[0]


def mean_over_ranks(values: list[float]) -> tuple[float, float, int]:
    """(mean, std, count) of per-sample values gathered over every rank."""
    world = world_rank_size()[1]
    # NCCL reduces device tensors only; gloo (CPU runs) host ones.
    nccl = world > 1 and dist.get_backend() == "nccl"
    device = with_index("cuda") if nccl else torch.device("cpu")
    t = torch.tensor([sum(values), sum(v * v for v in values), len(values)], dtype=torch.float64,
                     device=device)
    if world > 1:
        t = all_reduce_(t)
    total, sq, n = t.tolist()
    mean = total / max(n, 1)
    return mean, max(sq / max(n, 1) - mean * mean, 0.0) ** 0.5, int(n)


def says_error(error: HandoffError) -> bool:
    """Whether this process prints `error`, the command's one line. Until the process group
    forms, the ranks of a launch have made the same checks on the same inputs (the config,
    the launch, the preflight, the run's data and rewards): local rank 0 says what failed,
    once a node (a node's files are its own). Once it has formed, each rank's work is its
    own (its card, its share of the samples): every rank says its error, as it says a
    RankError at any time. A launch whose variables are refused says so in every process."""
    if isinstance(error, RankError) or dist.is_initialized():
        return True
    try:
        launch = launch_env()
    except HandoffError:
        return True
    return launch is None or launch[2] == 0


def end_distributed_run() -> None:
    """Every rank, once its outputs are written: tear the groups down; a rank of a multi-process
    launch then exits at once, with status 0, skipping the interpreter's finalization.

    Why exit at once: gloo's worker threads outlive `destroy_process_group` whenever a group is
    still referenced (FSDP2's DTensor sharding caches keep the mesh, and so the group, alive),
    and such a thread may still run Python just after a collective completes, which takes the
    GIL. Python ends a thread that takes the GIL while the interpreter finalizes with
    pthread_exit, whose unwinding through gloo's C++ aborts the process ("terminate called
    without an active exception"; tests/test_dist.py makes that race certain). The barrier
    first makes sure every rank has finished its collectives.
    """
    if not dist.is_initialized():
        return
    world = dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    if world > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
