"""Writes, under whichever Python runs it, what the test resumes under its own Python.

    python python_checkpoint_job.py checkpoint MODEL ROOT   # a handoff checkpoint (needs torch)
    python python_checkpoint_job.py objects OUT             # no torch: DCP's enum, paths

`objects` pickles, with this Python's own pickle and enum modules, the objects DCP's metadata
holds beside torch's own (its memory-format enum, POSIX paths, an OrderedDict), through a
stand-in `torch.distributed.checkpoint.metadata` module whose enum has DCP's members: how
this Python encodes them is what the allow-list must read.
"""

import pickle
import sys
import tempfile
from pathlib import Path

STAND_IN = '''
from enum import Enum


class _MEM_FORMAT_ENCODING(Enum):
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2
'''


def checkpoint(model: str, root: str) -> None:
    from handoff.config import ActorConfig
    from handoff.trainer.actor import Actor
    from handoff.trainer.checkpoint import save_checkpoint

    actor = Actor(model, actor=ActorConfig(), dtype="float32")
    for t in actor.part_tensors("params"):
        t.fill_(0.25)
    save_checkpoint(root, actor, step=3, extra={"task": {"pos": 7}})


def objects(out: str) -> None:
    import collections
    import pathlib

    stand_in = Path(tempfile.mkdtemp()) / "torch" / "distributed" / "checkpoint"
    stand_in.mkdir(parents=True)
    for package in (stand_in, stand_in.parent, stand_in.parent.parent):
        (package / "__init__.py").write_text("")
    (stand_in / "metadata.py").write_text(STAND_IN)
    sys.path.insert(0, str(stand_in.parents[2]))
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    graph = {"formats": list(_MEM_FORMAT_ENCODING),
             "paths": [pathlib.PosixPath("/ckpt/x"), pathlib.PurePosixPath("__0_0.distcp")],
             "ordered": collections.OrderedDict(a=1)}
    Path(out).write_bytes(pickle.dumps(graph, protocol=pickle.DEFAULT_PROTOCOL))


if __name__ == "__main__":
    {"checkpoint": checkpoint, "objects": objects}[sys.argv[1]](*sys.argv[2:])
