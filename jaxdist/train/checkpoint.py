"""Checkpoints through orbax's manager: the canonical train state, sharded, written in the background.

Each checkpoint holds the run's canonical state (`jaxdist.core.canonical`: the
parameters by parameter path, the optimizer state of a single-device optax
run, the step, the model's other variables) and metadata (model config,
layout, schedule, data). The arrays are written as safetensors files by
`jaxdist.train.array_files` (each process its shards of replica 0, in up to 8
files side by side, at the disk's speed); `run.checkpoint_compress` writes
orbax's zstd-compressed zarr arrays instead, the form older checkpoints hold.
A restore reads each array straight into the shardings of the target run's
canonical form (`run.canonical_target()`), whatever layout saved it, and the
run converts it to its own layout (`run.from_canonical`) inside jit: no device
and no host ever holds a whole copy.

Saves are asynchronous: `save` enqueues a copy of every array into host memory
(pinned where the backend has it, one replica of each shard, the arrays whole on one
device packed into a few transfers per device: `jaxdist.train.host_copy`) and returns
without waiting for it; the next step may donate and overwrite the
state at once, the runtime ordering it behind the copies' reads. A background
thread hands the copies to orbax's manager, which saves synchronously on it (with
several processes the manager's save is started in `save` instead, asynchronously, as
its barriers are device collectives that must keep the loop's order). At most one save is in flight
(`save` and `wait` finish the previous one first). Orbax writes a checkpoint to a
temporary directory and renames it when every process's writes are complete, so
an interrupted save (a crash, kill -9) never touches the previous checkpoints;
only the newest `keep` are kept.

After each save the size and CRC-32 of every file go into `jaxdist.train.checksums`'s
file (older checkpoints: its first form): the array files' sums are taken as they are written,
the other files' read back (one CRC per 16 MiB piece of a file, on several threads,
with ISA-L's CRC-32: the same sums as zlib's, ~5x faster per core). A checkpoint
that fails them, or that cannot be read, is moved to `checkpoints.unreadable/` and
the previous one is used instead. `timings` holds the seconds of the last save's
background parts.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxdist.train import checksums
from jaxdist.train.array_files import read_tree
from jaxdist.train.arrays_handler import ArraysHandler, ArraysRestore, ArraysSave
from jaxdist.train.config import ConfigError
from jaxdist.train.host_copy import start_host_copy, wait_for_host_copy
from jaxdist.train.orbax_logs import DropOrbaxLogs
from jaxdist.train.peers import tell_peers
from jaxdist.train.process_zero import ProcessZeroError, on_process_zero
from jaxdist.train.report import disk_full, first_line, warn, write_problem

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message is one line and names the fix."""


# Orbax's default OCDBT store (zarr v2 arrays) appends every array to a few data files of up to 2 GB, each
# written by one writer: a GPT-124M train state (1.39 GiB) went to an H200 host's tmpfs at 1.7 GiB/s, where
# 8 threads write 14.8 GiB/s. Zarr v3 arrays in data files of 64 MiB are written side by side: 5.8-7.1 GiB/s
# there (bench/checkpoint_write.py). Both forms restore, whichever form the reader writes.
DATA_FILE_BYTES = 64 << 20


def _registry() -> dict:
    registry = _type_handlers()
    return {} if registry is None else {"type_handler_registry": registry}


def _type_handlers():
    """Orbax's standard type handlers, but arrays written without their `_sharding` file: orbax writes
    it one array after another (a GPT-124M train state has ~450), and a restore reads onto the target's
    shardings, never the saved ones. None (orbax's defaults) if this orbax keeps its parts elsewhere."""
    try:
        from orbax.checkpoint._src.metadata.array_metadata_store import Store

        arrays = ocp.type_handlers.ArrayHandler(array_metadata_store=Store(), enable_write_sharding_file=False)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover (another orbax: its default handlers)
        return None
    standard = (int, float, bytes, np.number, np.ndarray, str, type(ocp.PLACEHOLDER))
    handlers = [(jax.Array, arrays)] + [(ty, ocp.type_handlers.get_type_handler(ty)) for ty in standard]
    return ocp.type_handlers.create_type_handler_registry(*handlers)


def _out_of_memory(e: BaseException) -> bool:
    """Whether `e` is the host or a device running out of memory (XLA says RESOURCE_EXHAUSTED, as tensorstore
    does for a full disk)."""
    if disk_full(e):
        return False
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


@dataclasses.dataclass(frozen=True)
class Staged:
    """A canonical state whose copies into host memory `Checkpoints.stage` has enqueued."""

    tree: object


class Checkpoints:
    """The run's checkpoints in `directory/checkpoints`, the newest `keep` kept. `compress` zstd-compresses
    the arrays (orbax's default): a float32 train state shrinks by ~8% and is written ~2x slower, so
    it is off unless asked for; a checkpoint of either kind restores. `pack`: whether a single process's
    uncompressed saves copy the arrays whole on one device packed, a few transfers per device (`host_copy`);
    None: where the devices are not the host's CPU (there the packing is one more copy in host memory,
    and a transfer per array costs nothing more)."""

    def __init__(
        self,
        directory: str | Path,
        keep: int,
        compress: bool = False,
        read_only: bool = False,
        pack: bool | None = None,
    ):
        self.directory = Path(directory).absolute() / "checkpoints"
        self.unreadable_dir = self.directory.with_name("checkpoints.unreadable")
        # read_only: a reader of a run another process may be training (sample, export) changes nothing in it
        self.read_only = read_only
        # arrays: what saves write (`array_files`); state: orbax's form, which compressed saves write and
        # checkpoints of earlier versions hold (both restore)
        self.compress = compress
        self.pack = jax.default_backend() != "cpu" if pack is None else pack
        self.arrays = ArraysHandler()
        handlers = {
            "arrays": self.arrays,
            "state": ocp.PyTreeCheckpointHandler(use_compression=compress, use_zarr3=True, **_registry()),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self._quiet = DropOrbaxLogs()
        self._quiet.attach()  # read_only: orbax warns that it is, and which options it ignores
        try:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max(1, keep),
                create=not read_only,
                read_only=read_only,
                # one process saves from a thread of its own (`_finish`), where orbax's own async machinery
                # (a thread per commit and per finalize, an event loop per call) only adds hand-offs: orbax
                # saves synchronously on that thread; several processes start orbax's save in the loop
                enable_async_checkpointing=jax.process_count() > 1,
                # the older checkpoints are deleted on a thread of their own once a save is in place: freeing a
                # 1.4 GiB one from a tmpfs took 0.2 s, which otherwise a save waits for (and the next, behind it)
                enable_background_delete=not read_only,
            )
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        finally:
            self._quiet.detach()
        self.pending: int | None = None  # the step whose save is in flight
        self._finishing: threading.Thread | None = None  # waits for orbax, then writes the checksums
        self._finish_error: BaseException | None = None
        self.timings: dict[str, float] = {}  # seconds of the last finished save's parts in the background
        self._verified: set[int] = set()  # steps whose files matched their checksums (a resume reads twice)
        self._unverified: dict[int, str] = {}  # steps whose checksum file (this name) could not be read

    def latest(self) -> int | None:
        """The newest step saved, or being saved (orbax learns of a save only when its writing starts)."""
        latest = self.manager.latest_step()
        return self.pending if self.pending is not None and (latest is None or self.pending > latest) else latest

    def stage(self, canonical) -> Staged:
        """Finish the save in flight, then enqueue the copies of `canonical` into host memory and return at
        once, waiting for none of its values: a loop stages while the device still runs its queued steps,
        and then checks that the state is worth saving. `save` takes what this returns."""
        self.wait()
        try:
            return Staged(self._host_copy(canonical))
        except Exception as e:
            raise CheckpointError(
                f"could not copy the state into host memory for a checkpoint: {first_line(e)}; "
                "free host memory or save less often"
            ) from None

    def save(self, step: int, canonical, meta: dict) -> None:
        """Start writing checkpoint `step` of the canonical state `canonical`, or of what `stage` returned
        for it (after finishing the save in flight). Returns once the copies of the values into host
        memory are enqueued (the next step may then donate and overwrite them; the runtime orders it
        behind the copies): orbax writes those copies in the background. With several processes orbax's
        save is started here (its barriers are collectives over the devices, which must keep the
        training loop's order), so the loop waits for the device-to-host copy. A failure (e.g. a full
        disk) leaves no partial checkpoint and raises CheckpointError, here or at the next `save` / `wait`."""
        self.wait()
        self._quiet.attach()
        # one process: started from the background; several: started here (orbax's barriers are collectives
        # over the devices). Compressed saves of several processes let orbax transfer the replica slices it
        # writes itself, which it finishes before its save returns.
        in_background = jax.process_count() == 1
        self.pending = step
        self.arrays.written = None  # what this save's writer records (none if it fails before writing)
        try:
            if isinstance(canonical, Staged):
                state = canonical.tree
            else:
                state = self._host_copy(canonical)
            if self.compress:
                item = {"state": ocp.args.PyTreeSave(state, ocdbt_target_data_file_size=DATA_FILE_BYTES)}
            else:
                item = {"arrays": ArraysSave(state, chunk_bytes=checksums.CHUNK_BYTES)}
            args = ocp.args.Composite(**item, meta=ocp.args.JsonSave(meta))
            if not in_background:
                # orbax's process 0 creates the step's directory while the others wait for word of it in the
                # key-value store, for 5 minutes, silent, if the creation fails (a read-only or inode-less
                # disk): tried first here, where a failure is every process's error at once
                on_process_zero(self._try_creating_a_directory, "creating the checkpoint's directory")
                self.manager.save(step, args=args, force=True)
        except Exception as e:
            self._failed(e)
        except BaseException:  # an interrupt before any write started: nothing is in flight
            self.pending = None
            raise
        # not a daemon: orbax's threads, started from this one, inherit it, and an exit must let a save
        # in flight finish (an unfinished one is never renamed into place, but it would be lost)
        self._finishing = threading.Thread(
            target=self._finish, args=(step, args if in_background else None), name="jaxdist-checkpoint"
        )
        self._finishing.start()

    def _try_creating_a_directory(self) -> None:
        Path(tempfile.mkdtemp(prefix=".jaxdist-write-check-", dir=self.directory)).rmdir()

    def _finish(self, step: int, args) -> None:
        """In the background: (start orbax's save of `args`, then) wait for orbax's writes of `step`, then
        record its checksums. `timings` gets the seconds of each part."""
        try:
            began = time.perf_counter()
            if args is not None and "state" in args:
                wait_for_host_copy(args["state"].item)  # the copies into host memory (timed apart)
            copied = time.perf_counter()
            if args is not None:
                self.manager.save(step, args=args, force=True)
            self.manager.wait_until_finished()
            written = time.perf_counter()
            if jax.process_index() == 0:
                self._write_checksums(step)
            done = time.perf_counter()
            self.timings = {"copy_s": copied - began, "write_s": written - copied, "checksum_s": done - written}
            if self.arrays.written is not None:  # the array writer's own split: waiting for the copies, writing
                split = self.arrays.written
                self.timings.update(copy_s=self.timings["copy_s"] + split.copy_s, write_s=split.write_s)
        except BaseException as e:  # noqa: BLE001 (raised in the caller's thread by `wait`)
            self._finish_error = e

    def _host_copy(self, canonical):
        """`canonical` with its host copies enqueued (`start_host_copy`), where saves copy the state themselves.
        The array files of one process take each device's arrays packed into runs, a transfer each (on an
        H200 a transfer per array cost the loop about twice as much); orbax's compressed form takes
        jax.Arrays."""
        if not self._copies_to_host():
            return canonical
        return start_host_copy(canonical, pack=self.pack and not self.compress and jax.process_count() == 1)

    def _copies_to_host(self) -> bool:
        """Whether a save copies the state into host memory itself (all but compressed saves of several
        processes, where orbax transfers the replica slices it writes)."""
        return jax.process_count() == 1 or not self.compress

    def warm_up(self, canonical) -> None:
        """Make (and drop) one host copy of `canonical`, as a save would, before the first save. The first
        copy into pinned host memory is slow (the host allocator takes its pages then and keeps them: on an
        H200, 1.16 s for a 1.4 GiB state, the later copies 0.02 s); the trainer calls this in its first
        step's window, so that cost does not fall on the loop at its first save."""
        jax.block_until_ready(canonical)
        if self._copies_to_host():
            wait_for_host_copy(self._host_copy(canonical))

    def wait(self) -> None:
        """Finish the save in flight (if any) and record its checksums."""
        if self.pending is None:
            return
        if self._finishing is not None:
            self._finishing.join()
            self._finishing = None
        error, self._finish_error = self._finish_error, None
        if error is not None:
            self._failed(error)
        self.pending = None
        self._quiet.detach()

    def _failed(self, e: Exception):
        # the log filter stays: orbax's background threads log this failure again at exit
        step, self.pending = self.pending, None
        self._discard_partial(step)
        full = disk_full(e)
        where, hint = ("", "free some space") if full else (f" in {self.directory}", "fix the cause")
        raise CheckpointError(
            f"could not save the checkpoint of step {step}{where}: {write_problem(e, self.directory)}; "
            f"{hint} and run again to resume from the previous checkpoint"
        ) from None

    def _discard_partial(self, step: int, settle_s: float = 1.0, limit_s: float = 30.0) -> None:
        """Remove the temporary directory of a failed save of `step`. The writes of its other items are still
        in flight (orbax does not cancel them) and recreate files, so wait until nothing reappears."""
        try:
            self.manager.close()  # drains orbax's own threads; tensorstore's writes may still land after it
        except Exception:
            pass
        pattern = f"{step}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}*"
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for tmp in self.directory.glob(pattern):
                shutil.rmtree(tmp, ignore_errors=True)
            time.sleep(settle_s)
            if not any(self.directory.glob(pattern)):
                return

    def _write_checksums(self, step: int) -> None:
        # this process's array file was summed while it was written; the other files are read back
        known = {}
        if self.arrays.written is not None and self.arrays.written.chunk_bytes == checksums.CHUNK_BYTES:
            known = {f"arrays/{name}": sums for name, sums in self.arrays.written.sums.items()}
        checksums.write_checksums(self.directory / str(step), known)

    def newest_readable(self, read: Callable[[int], T], below: int | None = None) -> tuple[int, T] | None:
        """`(step, read(step))` for the newest checkpoint (older than `below`, if given) that verifies and
        reads; each newer one that fails is moved aside with a one-line warning (read-only: left in place,
        and one deleted meanwhile by the run's trainer skipped quietly). None if there is none. With several
        processes a failed read of a verified checkpoint stops the resume instead (`_read_failed_on_this_process`)."""
        steps = sorted((s for s in self.manager.all_steps() if below is None or s < below), reverse=True)
        for step in steps:
            reason = self._verdict(step)
            if reason is None:
                try:
                    return step, read(step)
                except ConfigError:
                    raise
                except Exception as e:
                    if _out_of_memory(e):  # says nothing about the checkpoint, which verified: keep it
                        raise CheckpointError(
                            f"reading checkpoint {self.directory / str(step)} ran out of memory ({first_line(e)}); "
                            "it is left in place: free memory (or restore onto more devices) and resume"
                        ) from e
                    if jax.process_count() > 1:
                        raise self._read_failed_on_this_process(step, e) from e
                    reason = first_line(e)
            older = step != steps[-1]  # whether one older is left to try
            if not self.read_only:
                self._set_aside(step, reason, older)
            elif (self.directory / str(step)).is_dir():
                self._unverified.pop(step, None)
                where = self.directory / str(step)
                then = "the previous one is tried" if older else "there is none older"
                warn(f"checkpoint {where} is unreadable ({reason}); left in place, {then}")
        return None

    def _read_failed_on_this_process(self, step: int, e: Exception) -> CheckpointError:
        """The error that ends a multi-process resume whose read of a verified checkpoint failed here.

        Other processes may have read it, and wait in the restore's closing barrier (a device
        collective): this process cannot join them in moving it aside (that collective would meet the
        barrier's and hang), and the files are good by process 0's checksums. So the run stops, the
        checkpoint kept; every process that failed alike says so. One whose read a failed peer cut off (the
        collective it waited in broke) names that peer and its error, which the peer left in jax's
        key-value store before it ended."""
        where, rank, said = self.directory / str(step), jax.process_index(), first_line(e)
        peers = tell_peers(f"jaxdist/read_failed/{step}/", str(rank), said)
        keep = (
            "its files matched their checksums on process 0, so it is left in place: check this host's view of "
            f"the directory and resume, or move {where} away to resume from the checkpoint before it"
        )
        if peers:
            peer, why = min(peers.items())
            return CheckpointError(
                f"process {peer} could not read checkpoint {where} ({why}), which ended process {rank}'s read too; "
                + keep.replace("this host's", f"process {peer}'s host's")
            )
        return CheckpointError(f"process {rank} could not read checkpoint {where} ({said}); {keep}")

    def _verdict(self, step: int) -> str | None:
        """None if `step`'s files match their checksums, else why not: decided by process 0 for all (it
        wrote the checksums; every process deciding alone, a transient read error on one would leave
        it alone in `_set_aside`'s barrier, and N processes would read every file N times)."""
        if step in self._verified:  # the same on every process: each took process 0's verdict
            return None
        try:
            on_process_zero(lambda: checksums.verify(self.directory / str(step)), f"verifying checkpoint {step}")
        except checksums.Unverifiable as e:  # process 0's own
            self._unverified[step] = e.name
            return first_line(e)
        except ProcessZeroError as e:  # another process's word of process 0's verdict
            return str(e)
        except Exception as e:
            return first_line(e)
        self._verified.add(step)
        step_dir = self.directory / str(step)
        if jax.process_index() == 0 and checksums.recorded_sums(step_dir) is None:
            warn(f"checkpoint {step_dir} has no checksum file (its save ended before writing it); read unverified")
        return None

    def _set_aside(self, step: int, reason: str, older: bool = True) -> None:
        """Move checkpoint `step` into `unreadable_dir` (never over one set aside before: nothing is deleted)."""
        self._verified.discard(step)
        target, copies = self.unreadable_dir / str(step), 1
        while target.exists():
            copies += 1
            target = self.unreadable_dir / f"{step}.{copies}"
        source, what, advice = self.directory / str(step), "is unreadable", ""
        if name := self._unverified.pop(step, None):  # its data files may be good: say how to use them anyway
            what = "cannot be verified"
            advice = f"; if you trust its files, delete {target / name} and move {target} back to {source}"
        then = "the previous one is tried instead" if older else "there is none older"
        warn(f"checkpoint {source} {what} ({reason}); moved to {target}; {then}{advice}")

        def move() -> None:
            target.parent.mkdir(exist_ok=True)
            shutil.move(source, target)

        try:
            on_process_zero(move, "moving it")
        except Exception as e:
            raise CheckpointError(
                f"could not move unreadable checkpoint {source} aside: {first_line(e)}; move or delete it yourself"
            ) from None
        self.manager.reload()

    def meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore(self, step: int, target):
        """The canonical state saved at `step`, read straight into the shapes and shardings of `target`
        (ShapeDtypeStructs with shardings, e.g. `run.canonical_target()`)."""
        if self._holds_arrays(step):
            return self.manager.restore(step, args=ocp.args.Composite(arrays=ArraysRestore(target))).arrays
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
        return self.manager.restore(step, args=ocp.args.Composite(state=args)).state

    def _holds_arrays(self, step: int) -> bool:
        """Whether checkpoint `step` holds `array_files` (else orbax's form: compressed, or an older save)."""
        return (self.directory / str(step) / "arrays").is_dir()

    def restore_params(self, step: int) -> dict:
        """Only the parameters saved at `step`, as host arrays (for export: the whole model in this process;
        the optimizer state is not read). Keys of lists come back as strings ("0", "1", ...)."""
        if self._holds_arrays(step):
            return read_tree(self.directory / str(step) / "arrays", "params")
        path = self.directory / str(step) / "state"
        absl_logger = logging.getLogger("absl")  # orbax warns that the item has no metadata of its own (the step has)
        absl_logger.addFilter(self._quiet)
        try:
            return self._read_params(path)
        finally:
            absl_logger.removeFilter(self._quiet)

    def restore_params_onto(self, step: int, place) -> dict:
        """Only the parameters saved at `step`, each read straight onto the sharding `place(shape)` returns
        (every device reads its own slices: for export without the whole model on one device or host)."""
        if self._holds_arrays(step):
            return read_tree(self.directory / str(step) / "arrays", "params", place)
        path = self.directory / str(step) / "state"
        absl_logger = logging.getLogger("absl")
        absl_logger.addFilter(self._quiet)
        try:
            with ocp.PyTreeCheckpointer() as reader:
                saved = reader.metadata(path).item_metadata.tree["params"]
                target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=place(m.shape)), saved)
                restore_args = ocp.checkpoint_utils.construct_restore_args(target)
                args = ocp.args.PyTreeRestore(
                    item={"params": target}, restore_args={"params": restore_args}, partial_restore=True
                )
                return reader.restore(path, args=args)["params"]
        finally:
            absl_logger.removeFilter(self._quiet)

    @staticmethod
    def _read_params(path: Path) -> dict:
        with ocp.PyTreeCheckpointer() as reader:
            saved = reader.metadata(path).item_metadata.tree["params"]
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
            args = ocp.args.PyTreeRestore(
                item={"params": saved}, restore_args={"params": as_numpy}, partial_restore=True
            )
            return reader.restore(path, args=args)["params"]

    def close(self) -> None:
        """Finish the save in flight, then release orbax's threads."""
        try:
            self.wait()
        finally:
            self.manager.close()
