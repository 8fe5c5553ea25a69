"""Save and load model and optimiser state with ``torch.distributed.checkpoint`` (DCP).

``get_state_dict`` turns a plain, DDP- or FSDP2-wrapped model and its optimiser into state
dicts keyed by parameter name (FQN), holding plain tensors or DTensors; DCP writes each
tensor's chunks from the ranks that hold them (a tensor replicated on several ranks, as
under DDP or over the domain axis, is written once) and records every chunk's global offset
in ``.metadata``. Loading asks DCP for exactly the chunks the loading ranks hold, so a
checkpoint saved on one mesh and wrapper loads on any other: 8 ranks with DDP into 2 ranks
with FSDP2, or into one process without a process group.

Every collective runs on ``process_group`` (DCP's plan and write exchanges, and the
broadcasts of ``on_coordinator``), so each carries that group's timeout; no other group or
store is used.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardsci.checkpoint._coordinator import on_coordinator
from shardsci.checkpoint._layout import (
    CheckpointError,
    begin_save,
    check_complete,
    commit_save,
    read_extra,
)

__all__ = ["load_checkpoint", "save_checkpoint"]

_MODEL, _OPTIM = "model", "optim"
_LISTED_KEYS = 5
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None = None,
    *,
    process_group: ProcessGroup | None = None,
    keep_last: int | None = 2,
) -> Path:
    """Save ``model``, ``optimizer`` and ``extra`` as checkpoint ``directory/step_<step>``.

    Collective: every rank of ``process_group`` calls it with the same arguments. Each rank
    writes the chunks of the state it holds; rank 0 writes ``extra`` and commits the
    checkpoint (see NOTE [Checkpoint commit protocol] in ``_layout.py``): a save killed at any
    point leaves the previous checkpoint intact and ``latest_checkpoint`` returning it.

    Parameters
    ----------
    directory
        Directory holding this run's checkpoints (created if missing), on a filesystem every
        rank sees.
    step
        Training step, ``>= 0``; names the checkpoint directory.
    model
        A plain, DDP- or FSDP2-wrapped module.
    optimizer
        The optimiser of ``model``'s parameters, or None to save the model only.
    extra
        Small run state, e.g. ``{"step": ..., "scheduler": sched.state_dict(), "rng": ...,
        "config": ...}``: anything ``torch.save`` can write. Only rank 0's is saved.
    process_group
        The group of ranks that hold the state; None for the default group.
    keep_last
        Complete checkpoints to keep, counting this one (``>= 1``); older ones are deleted
        once this one is committed. None keeps all.

    Returns
    -------
    Path
        The committed checkpoint directory, e.g. ``directory/step_000123``.

    Raises
    ------
    ValueError
        If ``step`` or ``keep_last`` is out of range.
    TypeError
        If ``extra`` is not a dict.
    CheckpointError
        On every rank, if any stage of the save failed; the checkpoint is then not committed.
    """
    _check_save_arguments(step, keep_last, extra)
    root = Path(directory)
    staging = on_coordinator(
        lambda: begin_save(root, step, dict(extra or {})),
        process_group,
        f"preparing the save of step {step} in {root}",
    )
    _run_dcp(
        dcp.save,
        _state_dict(model, optimizer),
        f"writing the state of step {step} into {staging}",
        storage_writer=FileSystemWriter(staging, sync_files=True),
        process_group=process_group,
    )
    return on_coordinator(
        lambda: commit_save(root, step, keep_last), process_group, f"committing {staging}"
    )


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    process_group: ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``model`` and ``optimizer``, in place; return ``extra``.

    Collective over ``process_group``. The model may be wrapped and sharded differently, on
    a different number of ranks, than when it was saved: each rank reads the chunks it needs.

    Parameters
    ----------
    path
        A complete checkpoint directory, e.g. from ``latest_checkpoint`` or
        ``resolve_resume``.
    model
        A plain, DDP- or FSDP2-wrapped module with the saved parameter names and shapes.
    optimizer
        The optimiser to restore (same kind and parameter groups as when saved), or None
        to load the model only.
    process_group
        The group of ranks that hold the state; None for the default group.

    Returns
    -------
    dict
        The ``extra`` given to ``save_checkpoint`` (rank 0's), on every rank.

    Raises
    ------
    CheckpointError
        On every rank, if ``path`` is not a complete checkpoint, its model entries do not
        match ``model`` (missing or unexpected names, other shapes), or DCP fails to read it
        (e.g. optimiser state of another kind).
    """
    checkpoint = Path(path)
    state = _state_dict(model, optimizer)
    expected = {name: _global_shape(value) for name, value in state[_MODEL].items()}
    extra = on_coordinator(
        lambda: _open(checkpoint, expected), process_group, f"opening checkpoint {checkpoint}"
    )
    _run_dcp(
        dcp.load,
        state,
        f"reading checkpoint {checkpoint}",
        storage_reader=FileSystemReader(checkpoint),
        process_group=process_group,
    )
    if optimizer is None:
        set_model_state_dict(model, state[_MODEL])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=state[_OPTIM]
        )
    return extra


def _check_save_arguments(step: int, keep_last: int | None, extra: dict[str, Any] | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last must be an int >= 1 or None (keep all), got {keep_last!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")


def _run_dcp(
    operation: Callable[..., Any], state: dict[str, Any], what: str, **kwargs: Any
) -> None:
    """Run ``dcp.save`` or ``dcp.load`` on ``state``; raise its failure as ``CheckpointError``.

    DCP raises ``CheckpointException`` on every rank when any rank failed. Without a default
    process group it runs in this process alone, which is intended here, so its warning that
    it assumes so is silenced.
    """
    no_dist = not dist.is_initialized()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        try:
            operation(state, no_dist=no_dist, **kwargs)
        except CheckpointException as exc:
            raise CheckpointError(f"{what} failed: {exc}") from exc


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The DCP state of ``model`` (and ``optimizer``), keyed by parameter name, unwrapped."""
    if optimizer is None:
        return {_MODEL: get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {_MODEL: model_state, _OPTIM: optim_state}


def _global_shape(value: Any) -> tuple[int, ...] | None:
    """The global shape of a state-dict tensor (a DTensor's is its unsharded one), else None."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _open(checkpoint: Path, expected: dict[str, tuple[int, ...] | None]) -> dict[str, Any]:
    """Check that ``checkpoint`` is complete and matches the model; return its ``extra``."""
    check_complete(checkpoint)
    metadata = FileSystemReader(checkpoint).read_metadata()
    _check_model_matches(checkpoint, metadata, expected)
    return read_extra(checkpoint)


def _check_model_matches(
    checkpoint: Path, metadata: Metadata, expected: dict[str, tuple[int, ...] | None]
) -> None:
    """Raise ``CheckpointError`` naming every model entry that the checkpoint lacks or adds,
    or that it holds with another shape."""
    prefix = _MODEL + "."
    saved = {
        key.removeprefix(prefix): entry
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }
    problems = []
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    if missing:
        problems.append(f"missing {_list(missing)}")
    if unexpected:
        problems.append(f"unexpected {_list(unexpected)}")
    for name in sorted(expected.keys() & saved.keys()):
        entry, shape = saved[name], expected[name]
        saved_shape = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        if saved_shape is not None and shape is not None and saved_shape != shape:
            problems.append(f"{name} is {saved_shape} in the checkpoint, {shape} in the model")
    if problems:
        raise CheckpointError(
            f"checkpoint {checkpoint} does not match the model: " + "; ".join(problems)
        )


def _list(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED_KEYS])
    more = len(names) - _LISTED_KEYS
    return f"{shown} (and {more} more)" if more > 0 else shown
