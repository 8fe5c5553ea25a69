"""Crash-safe checkpoints that load on any mesh, built on ``torch.distributed.checkpoint``.

``save_checkpoint(directory, step, model, optimizer, extra)`` writes ``directory/step_<N>``
from every rank, collectively, and commits it atomically (NOTE [Checkpoint commit protocol]
in ``_layout.py``): a save killed mid-write leaves the previous checkpoint intact, and the
next save removes the half-written one. ``latest_checkpoint(directory)`` finds the newest
committed checkpoint, ``resolve_resume(directory, resume)`` applies a ``"auto"``/``"never"``/
path setting, and ``load_checkpoint(path, model, optimizer)`` restores the state into a
plain, DDP- or FSDP2-wrapped model on any number of ranks and returns ``extra``.

Loading runs no code from the checkpoint, whoever wrote it (NOTE [What a checkpoint may hold]
in ``_metadata.py``). ``check_checkpoint(path, model, optimizer)``, which ``load_checkpoint``
runs first, refuses a checkpoint holding anything but what ``save_checkpoint`` writes, one
truncated or missing a shard, or one of another model or optimiser. Errors are
``CheckpointError``, one line naming the file and what was expected, raised on every rank of
the group.

Example
-------
>>> path = resolve_resume(run_dir / "checkpoints", cfg.resume)  # doctest: +SKIP
>>> extra = load_checkpoint(path, model, optimizer) if path else {"step": 0}  # doctest: +SKIP
>>> save_checkpoint(run_dir / "checkpoints", step, model, optimizer, {"step": step})  # doctest: +SKIP
"""

from shardsci.checkpoint._dcp import check_checkpoint, load_checkpoint, save_checkpoint
from shardsci.checkpoint._errors import CheckpointError
from shardsci.checkpoint._layout import latest_checkpoint
from shardsci.checkpoint._resume import resolve_resume

__all__ = [
    "CheckpointError",
    "check_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "resolve_resume",
    "save_checkpoint",
]
