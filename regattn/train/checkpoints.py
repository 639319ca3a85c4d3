"""Checkpoints are read as data: tensors, dicts, lists, tuples, str, int, float, bool and None.

A checkpoint from elsewhere must not run code when it is loaded. ``torch.save`` files are read with
``torch.load(weights_only=True)``. A ``torch.distributed.checkpoint`` folder has two pickles that
torch reads without that restriction: its ``.metadata`` (checked here first by an unpickler that
builds only the checkpoint's own metadata classes) and its non-tensor entries (read here with
``weights_only=True`` instead). Anything else in them raises :class:`UnsafeCheckpointError`.
"""
from __future__ import annotations

import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something other than tensors and plain data."""


def refuse(what: str, error: Exception) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"checkpoint: {what} holds objects other than tensors and plain data; "
                                 f"refusing to load it ({str(error).strip().splitlines()[0]})")


def load_data(path: str, map_location="cpu"):
    """``torch.load(path, weights_only=True)``; :class:`UnsafeCheckpointError` for any other object."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise refuse(path, e) from None


# ---------------------------------------------------------------------------------------------- dcp folders
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "torch": {"Size"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Builds the classes of :data:`METADATA_CLASSES` and torch dtypes; any other global is refused."""

    def find_class(self, module, name):
        if name in METADATA_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                        torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not checkpoint metadata")


def check_metadata(folder: str) -> None:
    """Unpickle every ``*.metadata`` file of a checkpoint folder with :class:`MetadataUnpickler`."""
    for name in sorted(os.listdir(folder)):
        if name.endswith(".metadata"):
            with open(os.path.join(folder, name), "rb") as f:
                try:
                    MetadataUnpickler(f).load()
                except pickle.UnpicklingError as e:
                    raise refuse(folder, e) from None


class DataOnlyPlanner(DefaultLoadPlanner):
    """Reads the non-tensor entries with ``weights_only=True`` (torch's planner unpickles them freely);
    what passes is plain data, handed on re-serialised."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            data = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise refuse(f"the entry {read_item.dest_index.fqn!r}", e) from None
        plain = io.BytesIO()
        torch.save(data, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


def load_folder(state: dict, path: str, *, no_dist: bool) -> None:
    """``dcp.load(state, path)`` after :func:`check_metadata`, through :class:`DataOnlyPlanner`."""
    check_metadata(path)
    try:
        dcp.load(state, checkpoint_id=path, planner=DataOnlyPlanner(), no_dist=no_dist)
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise
