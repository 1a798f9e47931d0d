"""Asynchronous checkpoint saves: the state is copied to host memory while the loop waits, then
written, hashed and committed in the background, with the guarantees of a synchronous save.

A save stages this rank's part through a `StagedFiles` (CheckpointFiles' verbs): whatever a
strategy hands to `save` is copied at once, every tensor to the CPU (torch's DefaultStager: shared
storages stay shared, so the bytes written equal a synchronous save's); DCP state goes to
`torch.distributed.checkpoint.async_save` (the same stager, its collectives on a gloo group of
their own so they never interleave with the loop's); files a library has already written itself
(DeepSpeed's) are only hashed later. A background thread then writes through CheckpointFiles,
waits for DCP, leaves this rank's digests and a `.written_rank<R>` marker. Rank 0's thread commits
(manifest, rename to `step_N`, `latest`, prune: launcher.components.checkpoint) once every rank's
marker is there, so the commit needs no collective off the loop's thread and a crash before it
leaves only `.partial_step_N`, which the next start reports and removes.

The loop meets the save again at the next save, or at the end of the session (`wait`): every
rank agrees (a collective AND) that it wrote, and a failure anywhere raises CheckpointSaveError on
every rank, naming the step, as a synchronous save does. At most one save is in flight.
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from launcher.components import checkpoint
from launcher.components.checkpoint_files import CheckpointFiles
from launcher.config.checkpoint import PARTIAL_PREFIX

STAGER_MIN_TORCH = (2, 13)
"""The oldest torch whose host-memory stager was seen to stage the loop's whole state (torch 2.11's raised
KeyError: <class 'type'> on it, on CPU and CUDA alike); older ones save synchronously."""
WRITTEN_PREFIX = ".written_rank"
"""A rank's marker in the partial directory: all its files and its digests are on disk."""
POLL_S = 0.05
"""How often rank 0's background thread looks for the other ranks' markers."""


def stager_works(torch_version: str) -> bool:
    """Whether background saves run on this torch version (STAGER_MIN_TORCH or newer)."""
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    return match is not None and (int(match[1]), int(match[2])) >= STAGER_MIN_TORCH


def background_saves(requested: bool) -> bool:
    """checkpoint.async_save as this torch allows it; a warning says so where a request falls back to blocking saves."""
    import torch

    if requested and not stager_works(torch.__version__):
        warnings.warn(
            f"checkpoint.async_save=true: torch {torch.__version__}'s host-memory stager cannot copy this loop's "
            f"state (it needs torch>={'.'.join(map(str, STAGER_MIN_TORCH))}), so checkpoints are saved "
            "synchronously; set checkpoint.async_save=false to silence this.",
            stacklevel=2,
        )
        return False
    return requested


def _stager() -> Any:
    """torch's synchronous host-memory stager; it keeps its CPU buffers for the next save."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


class StagedFiles:
    """One rank's part of a checkpoint: copied to host memory now, written in the background."""

    def __init__(self, directory: Path, rank: int, stager: Any, group: Callable[[], Any]) -> None:
        self.directory = Path(directory)
        """The partial checkpoint directory (every rank writes into the same one)."""
        self.rank = rank
        """This rank."""
        self._stager, self._group = stager, group
        self._writes: list[Callable[[CheckpointFiles], None]] = []

    def save(self, obj: object, name: str) -> None:
        """Copy `obj` now (every tensor to the CPU); torch.save it to directory/name in the background."""
        staged = self._stager.stage(obj)
        self._writes.append(lambda files: files.save(staged, name))

    def adopt(self, paths: Iterable[Path]) -> None:
        """Hash, in the background, files a library has already written into the directory."""
        written = list(paths)
        self._writes.append(lambda files: files.adopt(written))

    def save_dcp(self, state: dict[str, Any], name: str, own_files: str) -> None:
        """Stage DCP state now and write it with torch's async_save into directory/name; then hash this
        rank's files (the glob `own_files`; rank 0's manifest adds the shared metadata)."""
        import torch.distributed.checkpoint as dcp

        target = self.directory / name
        future = dcp.async_save(
            state, checkpoint_id=target, process_group=self._group(), async_stager=self._stager
        )

        def written(files: CheckpointFiles) -> None:
            future.result()
            files.adopt(sorted(target.glob(own_files)))

        self._writes.append(written)

    def write(self) -> None:
        """Write everything staged, then leave this rank's digests (in the background thread)."""
        files = CheckpointFiles(self.directory, self.rank)
        for write in self._writes:
            write(files)
        files.finish()


class _Job:
    """One save in flight."""

    def __init__(self, step: int, partial: Path, final: Path, info: dict[str, Any]) -> None:
        self.step, self.partial, self.final, self.info = step, partial, final, info
        self.written = threading.Event()
        """Set when this rank's write ended, well or not."""
        self.write_error: BaseException | None = None
        self.commit_error: BaseException | None = None
        self.decided: bool | None = None
        """Rank 0: set by the loop once the ranks agreed (True: all wrote); the commit stops waiting for markers."""
        self.thread: threading.Thread | None = None


class AsyncSaver:
    """Checkpoints staged on the loop's thread, written and committed in the background; one at a time."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        world_size: int,
        keep: int,
        agree: Callable[[bool], bool],
        timeout_s: float,
    ) -> None:
        self.run_dir, self.rank, self.world_size, self.keep = Path(run_dir), rank, world_size, keep
        self._agree, self._timeout_s = agree, timeout_s
        self._stager = _stager()
        self._group_handle: Any = None
        self._job: _Job | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._job is not None

    def _group(self) -> Any:
        """A gloo group for DCP's background collectives, made once (collectively: every rank saves together)."""
        if self._group_handle is None:
            from datetime import timedelta

            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._group_handle = dist.new_group(
                    backend="gloo", timeout=timedelta(seconds=self._timeout_s)
                )
        return self._group_handle

    def start(
        self, step: int, stage: Callable[[StagedFiles], None], *, info: dict[str, Any] | None = None
    ) -> Path:
        """Stage a checkpoint of `step` through `stage(files)` on every rank and start writing it.

        Waits for the save before (raising its failure), prepares the partial directory on rank 0
        (agreed), stages, and returns the directory the checkpoint will have once committed.
        """
        self.wait()
        base = checkpoint.root(self.run_dir)
        job = _Job(step, base / f"{PARTIAL_PREFIX}step_{step}", base / f"step_{step}", info or {})
        error = checkpoint.attempt(checkpoint.prepare, job.partial) if self.rank == 0 else None
        if not self._agree(error is None):
            raise checkpoint.CheckpointSaveError(self._failure(job, error or RuntimeError("rank 0 failed")))
        files = StagedFiles(job.partial, self.rank, self._stager, self._group)
        job.write_error = checkpoint.attempt(stage, files)
        self._job = job
        job.thread = threading.Thread(
            target=self._background, args=(job, files), name=f"checkpoint-step-{step}", daemon=True
        )
        job.thread.start()
        return job.final

    def _background(self, job: _Job, files: StagedFiles) -> None:
        """Write this rank's part and mark it; rank 0 then commits once every rank has marked."""
        try:
            if job.write_error is None:
                job.write_error = checkpoint.attempt(self._write, job, files)
        finally:
            job.written.set()
        if self.rank == 0 and job.write_error is None:
            job.commit_error = checkpoint.attempt(self._commit_when_written, job)

    def _write(self, job: _Job, files: StagedFiles) -> None:
        files.write()
        (job.partial / f"{WRITTEN_PREFIX}{self.rank}").touch()

    def _commit_when_written(self, job: _Job) -> None:
        markers = [job.partial / f"{WRITTEN_PREFIX}{r}" for r in range(self.world_size)]
        while not all(m.exists() for m in markers):
            if job.decided is False:
                return  # a rank failed: the loop reports it and removes the directory
            time.sleep(POLL_S)
        for marker in markers:
            marker.unlink()
        checkpoint.commit(self.run_dir, job.partial, job.final, job.step, job.info, keep=self.keep)

    def wait(self) -> Path | None:
        """Wait for the save in flight and agree on it (every rank calls it); its directory, or None.

        Raises CheckpointSaveError on every rank when any rank failed to write it or rank 0 to commit it.
        """
        job, self._job = self._job, None
        if job is None:
            return None
        job.written.wait()
        ok = self._agree(job.write_error is None)
        error = job.write_error
        if self.rank == 0:
            job.decided = ok
            job.thread.join()
            error = error or job.commit_error
        if error is None and not ok:
            error = RuntimeError("another rank failed while writing its part")
        if not self._agree(error is None):
            raise checkpoint.CheckpointSaveError(self._failure(job, error))
        return job.final

    def _failure(self, job: _Job, error: BaseException | None) -> str:
        if self.rank == 0:
            return checkpoint.failure_text(self.run_dir, job.partial, job.step, error)
        return f"the checkpoint of step {job.step} was not written ({error or 'rank 0 failed'})."

    def close(self, *, timeout_s: float | None = None) -> None:
        """Stop without agreeing (a run that failed): wait up to `timeout_s` for this rank's write and give
        up the commit unless it has begun; a save left unfinished stays `.partial_step_N`."""
        job, self._job = self._job, None
        if job is not None:
            job.written.wait(self._timeout_s if timeout_s is None else timeout_s)
            job.decided = False if job.decided is None else job.decided
            job.thread.join(timeout=POLL_S * 4)
        self._stager.close()
