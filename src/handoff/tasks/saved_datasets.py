"""Rows from a `datasets` dataset: a directory written by `save_to_disk`, or a Hub dataset id
already in the local Hugging Face cache. Never the network: a Hub id that is not cached is one
line naming the `huggingface-cli download` command to run.

    rows = load_dataset_rows("data/gsm8k_saved", split="train")          # save_to_disk
    rows = load_dataset_rows("openai/gsm8k", split="test", subset="main")  # the local cache

`datasets` is optional (`pip install datasets`, or the `handoff[datasets]` extra); JSONL and
Parquet files need none of it (dataset.py).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Iterator

from handoff.errors import HandoffError

# owner/name or name, as the Hub spells dataset ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_like_hub_id(source: str) -> bool:
    return _HUB_ID.fullmatch(source) is not None


def load_dataset_rows(source: str | Path, *, split: str = "train",
                      subset: str | None = None) -> list[dict[str, Any]]:
    """Every row of a save_to_disk directory or of a cached Hub dataset's split, as dicts."""
    datasets = _datasets(source)
    path = Path(source)
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise HandoffError(f"{str(path)!r} is a directory but not a `datasets` dataset "
                               f"({_first_line(e)}): point data.path at a save_to_disk "
                               "directory, a JSONL or a Parquet file") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise HandoffError(f"{str(path)!r} has no split {split!r} (its splits: "
                                   f"{', '.join(loaded)}): set data.split to one of them")
            loaded = loaded[split]
        return loaded.to_list()
    snapshot = _cached_snapshot(str(source))
    with _offline(datasets):
        try:
            loaded = datasets.load_dataset(str(snapshot), name=subset, split=split)
        except ValueError as e:
            raise HandoffError(f"Hub dataset {str(source)!r} (cached at {snapshot}): "
                               f"{_first_line(e)}: check data.split and data.subset") from None
    return loaded.to_list()


def _cached_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except LocalEntryNotFoundError:
        raise HandoffError(
            f"data.path {repo_id!r} is not a file or a directory here, and no Hub dataset of that "
            "id is in the local Hugging Face cache: run `huggingface-cli download --repo-type "
            f"dataset {repo_id}` (handoff never downloads), or fix the path") from None


@contextlib.contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """datasets and huggingface_hub read their offline switch at import: set it for the call."""
    import huggingface_hub.constants as hub

    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _datasets(source: str | Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise HandoffError(f"reading {str(source)!r} (a `datasets` directory or Hub id) needs "
                           "the datasets library: pip install datasets") from None
    return datasets


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
