"""Orbax's item handler for a train state's array files (`jaxdist.train.array_files`).

Orbax creates the checkpoint's temporary directory, runs `write_arrays` in its commit thread and renames
the checkpoint into place once every process's write has returned; a restore reads the files onto the
target's shardings. `Checkpoints` registers it beside orbax's own handlers (whose zarr arrays
compressed saves write).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jaxdist.train.array_files import CHUNK_BYTES, Written, restore_arrays, write_arrays


class ArraysHandler(ocp.AsyncCheckpointHandler):
    """Orbax's item handler for `write_arrays`: orbax creates the temporary directory, runs the write in its
    commit thread and renames the checkpoint once every process's write has returned. `written` is what
    the last save of this process wrote (`Checkpoints` records its checksums without a second read)."""

    def __init__(self):
        self.written: Written | None = None

    async def async_save(self, directory, args: ArraysSave):
        async def write():
            self.written = write_arrays(Path(await _created(directory)), args.item, args.chunk_bytes)

        self.written = None
        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="jaxdist_arrays_save")]

    def save(self, directory, args: ArraysSave):
        self.written = write_arrays(Path(directory), args.item, args.chunk_bytes)

    def restore(self, directory, args: ArraysRestore):
        return restore_arrays(Path(directory), args.item)


async def _created(directory):
    """The directory's path, once it exists (orbax may hand a directory still being created)."""
    awaiting = getattr(directory, "await_creation", None)
    return await awaiting() if awaiting is not None else directory


@ocp.args.register_with_handler(ArraysHandler, for_save=True)
@dataclasses.dataclass
class ArraysSave(ocp.args.CheckpointArgs):
    item: Any
    chunk_bytes: int = CHUNK_BYTES  # the pieces each CRC-32 covers


@ocp.args.register_with_handler(ArraysHandler, for_restore=True)
@dataclasses.dataclass
class ArraysRestore(ocp.args.CheckpointArgs):
    item: Any  # the target: ShapeDtypeStructs with shardings
