"""Orbax checkpoints of a training run: params, optimizer state and the data position.

One `CheckpointManager` step directory per save, written asynchronously (the device->host copy
happens in `save`, the file writes in the background) and atomically (a half-written step is
never listed), by every process for its own shards (multi-host safe). Arrays are restored with
the shardings of the live state they replace.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

MAX_TO_KEEP = 2


def _abstract(tree: Any) -> Any:
    """Shape, dtype and sharding of every array of a pytree (the restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    """Saves every `every` steps (and when forced) into `directory`; restores the latest."""

    def __init__(self, directory: str | os.PathLike, every: int, *, asynchronous: bool = True):
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(every, 1),
            max_to_keep=MAX_TO_KEEP,
            enable_async_checkpointing=asynchronous,
        )
        self.directory = os.path.abspath(os.fspath(directory))
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """Steps completed at the newest finished checkpoint, or None when there is none."""
        return self.manager.latest_step()

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

    def meta(self, step: int) -> dict:
        """The JSON metadata saved with checkpoint `step` (read without touching the arrays)."""
        got = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(got.meta)

    def restore(self, step: int, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """(params, opt_state) of checkpoint `step`, shaped and sharded like the arguments."""
        target = _abstract({"params": params, "opt_state": opt_state})
        got = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )
        return got.state["params"], got.state["opt_state"]

    def close(self) -> None:
        """Wait for pending writes and release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
