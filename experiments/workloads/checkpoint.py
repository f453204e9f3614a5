"""Orbax checkpoints of a training run: params, optimizer state and the data position.

One `CheckpointManager` step directory per save, written asynchronously (the device->host copy
and the step directory's creation happen in `save`, the file writes in the background) and
atomically (a half-written step is never listed), by every process for its own shards
(multi-host safe). Arrays are restored with the shardings of the live state they replace. A
step whose files cannot be read back raises DamagedCheckpoint, naming its step and folder.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp

from experiments.core.outcomes import OOM, classify

MAX_TO_KEEP = 2
REASON_CHARS = 200  # of a read error's message in DamagedCheckpoint's one line
DATA_ERRORS = (OSError, ValueError, KeyError, TypeError)  # what unreadable files raise
ABANDONED_READ = "_read_array_index_and_device_put"  # Orbax's coroutine reading one array shard


class DamagedCheckpoint(Exception):
    """A checkpoint step whose files cannot be read back (truncated, garbled or missing)."""

    def __init__(self, step: int, path: str, error: BaseException) -> None:
        super().__init__(f"checkpoint step {step} at {path} is damaged ({_one_line(error)})")


def _root_cause(error: BaseException) -> BaseException:
    """The innermost explicit cause of an error (Orbax wraps TensorStore's precise read error;
    __context__ is not followed: it may be an unrelated error being handled at the time)."""
    seen = {id(error)}
    while (inner := error.__cause__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    return error


def _one_line(error: BaseException) -> str:
    """'Type: first line of the message', cut to REASON_CHARS."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:REASON_CHARS]


def _is_damage(error: BaseException) -> bool:
    """Whether a read error says the files are bad (not, say, that memory ran out)."""
    root = _root_cause(error)
    return isinstance(root, DATA_ERRORS) and classify(root)[0] != OOM


def _drop_abandoned_read_errors() -> None:
    """From now on, drop the errors of Orbax's abandoned array reads: when one read of a restore
    fails, the others are left unfinished, and Python prints each one's error ('Exception
    ignored in: <coroutine ...>' and a TensorStore spec, ~45 lines apiece) whenever it is
    collected. Other unraisable errors go to the hook in place before."""
    previous = sys.unraisablehook
    if getattr(previous, "drops", None) == ABANDONED_READ:
        return

    def hook(unraisable: Any) -> None:
        if getattr(unraisable.object, "__qualname__", None) != ABANDONED_READ:
            previous(unraisable)

    hook.drops = ABANDONED_READ
    sys.unraisablehook = hook


def _async_options() -> ocp.AsyncOptions:
    """Step folders made inside save(): one that fails to appear in a background thread leaves
    Orbax's (non-daemon) writer threads waiting 300 s for it, and the process cannot exit.
    (Orbax releases without the option keep their default.)"""
    try:
        return ocp.AsyncOptions(create_directories_asynchronously=False)
    except TypeError:
        return ocp.AsyncOptions()


def _abstract(tree: Any) -> Any:
    """Shape, dtype and sharding of every array of a pytree (the restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    """Saves every `every` steps (and when forced) into `directory`; lists, restores and
    deletes its steps."""

    def __init__(self, directory: str | os.PathLike, every: int, *, asynchronous: bool = True):
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(every, 1),
            max_to_keep=MAX_TO_KEEP,
            enable_async_checkpointing=asynchronous,
            async_options=_async_options(),
        )
        self.directory = os.path.abspath(os.fspath(directory))
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """Steps of the finished checkpoints, newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def step_dir(self, step: int) -> str:
        """The folder of checkpoint `step`."""
        return os.path.join(self.directory, str(step))

    def delete(self, step: int) -> None:
        """Remove checkpoint `step` (a damaged one, so that the run can write that step again)."""
        self.manager.delete(step)

    def save(
        self, step: int, params: Any, opt_state: Any, meta: dict, *, force: bool = False
    ) -> bool:
        """Checkpoint the state after `step` completed steps if it is a save step (or forced)."""
        state = {"params": params, "opt_state": opt_state}
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def _read(self, step: int, args: ocp.args.Composite) -> Any:
        """Restore `args` of checkpoint `step`; an error that says its files are bad is raised as
        DamagedCheckpoint."""
        _drop_abandoned_read_errors()  # before: a failed read may leave its errors at once
        try:
            return self.manager.restore(step, args=args)
        except Exception as e:
            if not _is_damage(e):
                raise
            raise DamagedCheckpoint(step, self.step_dir(step), _root_cause(e)) from e

    def meta(self, step: int) -> dict:
        """The JSON metadata saved with checkpoint `step` (read without touching the arrays)."""
        return dict(self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def restore(self, step: int, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """(params, opt_state) of checkpoint `step`, shaped and sharded like the arguments."""
        target = _abstract({"params": params, "opt_state": opt_state})
        got = self._read(step, ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        return got.state["params"], got.state["opt_state"]

    def close(self) -> None:
        """Wait for pending writes and release the manager, also when a write failed (then its
        error is raised after the release)."""
        try:
            self.manager.wait_until_finished()
        finally:
            self.manager.close()  # a failed write raises once: this close releases everything
