"""Crash-safe checkpoints that load on any mesh, built on ``torch.distributed.checkpoint``.

``save_checkpoint(directory, step, model, optimizer, extra)`` writes ``directory/step_<N>``
from every rank, collectively, and commits it atomically (NOTE [Checkpoint commit protocol]
in ``_layout.py``): a save killed mid-write leaves the previous checkpoint intact, and the
next save removes the half-written one. ``latest_checkpoint(directory)`` finds the newest
committed checkpoint, ``resolve_resume(directory, resume)`` applies a ``"auto"``/``"never"``/
path setting, and ``load_checkpoint(path, model, optimizer)`` restores the state into a
plain, DDP- or FSDP2-wrapped model on any number of ranks and returns ``extra``. Errors are
``CheckpointError``, raised on every rank of the group.

Example
-------
>>> path = resolve_resume(run_dir / "checkpoints", cfg.resume)  # doctest: +SKIP
>>> extra = load_checkpoint(path, model, optimizer) if path else {"step": 0}  # doctest: +SKIP
>>> save_checkpoint(run_dir / "checkpoints", step, model, optimizer, {"step": step})  # doctest: +SKIP
"""

from shardsci.checkpoint._dcp import load_checkpoint, save_checkpoint
from shardsci.checkpoint._layout import CheckpointError, latest_checkpoint
from shardsci.checkpoint._resume import resolve_resume

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "resolve_resume",
    "save_checkpoint",
]
