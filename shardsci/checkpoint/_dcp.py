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
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardsci.checkpoint._coordinator import on_coordinator
from shardsci.checkpoint._errors import CheckpointError, reason
from shardsci.checkpoint._layout import begin_save, commit_save
from shardsci.checkpoint._reader import CheckedReader, RestrictedPlanner
from shardsci.checkpoint._verify import (
    CheckedFiles,
    check_state_matches,
    tensor_entries,
    verify_files,
)

__all__ = ["check_checkpoint", "load_checkpoint", "save_checkpoint"]

_MODEL, _OPTIM = "model", "optim"
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
        "config": ...}``: tensors and plain values only (what ``torch.load(weights_only=True)``
        reads; numpy arrays as tensors), so that loading it runs no code. Only rank 0's is
        saved; it is loaded as plain data (a config in it is never instantiated).
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
        On every rank, if ``extra`` holds anything but tensors and plain values, or any stage
        of the save failed; the checkpoint is then not committed.
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
    The checkpoint first passes ``check_checkpoint``, and no file of it is unpickled outside
    an allowlist (NOTE [What a checkpoint may hold] in ``_metadata.py``): a checkpoint from
    anyone runs no code here.

    Parameters
    ----------
    path
        A complete checkpoint directory, e.g. from ``latest_checkpoint`` or
        ``resolve_resume``.
    model
        A plain, DDP- or FSDP2-wrapped module with the saved parameter names, shapes and
        dtypes.
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
        On every rank, with one line naming the file or the entries at fault: as
        ``check_checkpoint``, or if a shard file's contents cannot be read as tensors and
        plain values.
    """
    checkpoint = Path(path)
    state = _state_dict(model, optimizer)
    checked = _checked(checkpoint, state, process_group)
    _run_dcp(
        dcp.load,
        state,
        f"reading checkpoint {checkpoint}",
        storage_reader=CheckedReader(checkpoint, checked.metadata),
        planner=RestrictedPlanner(),
        process_group=process_group,
    )
    if optimizer is None:
        set_model_state_dict(model, state[_MODEL])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=state[_OPTIM]
        )
    return checked.extra


def check_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: ProcessGroup | None = None,
) -> dict[str, Any]:
    """Check that ``path`` is a checkpoint that loads, without loading it; return ``extra``.

    The check ``load_checkpoint`` makes first (so resuming a run and any command loading
    weights make it too). Collective over ``process_group``: rank 0 reads the checkpoint's
    ``.metadata`` and ``extra.pt`` through allowlists and the sizes of its shard files, and
    every rank raises what it found. Without a process group it runs here alone.

    Parameters
    ----------
    path
        The checkpoint directory.
    model, optimizer
        If given, the checkpoint must hold their tensors, with the same names, global shapes
        and dtypes, and no others; ``optimizer`` only with ``model``.
    process_group
        The group of ranks that will load it; None for the default group.

    Returns
    -------
    dict
        The ``extra`` given to ``save_checkpoint``, on every rank.

    Raises
    ------
    CheckpointError
        On every rank, with one line naming the file and what was expected, if the checkpoint
        is incomplete, a file holds anything but what DCP and ``save_checkpoint`` write
        (nothing from it is run), a shard file is missing or truncated, or the checkpoint is
        of another model or optimiser.
    """
    if model is None and optimizer is not None:
        raise ValueError("check_checkpoint: an optimizer is checked only together with its model")
    state = _state_dict(model, optimizer) if model is not None else {}
    return _checked(Path(path), state, process_group).extra


def _checked(
    checkpoint: Path, state: dict[str, Any], process_group: ProcessGroup | None
) -> CheckedFiles:
    """``verify_files`` and ``check_state_matches`` on rank 0, their result on every rank."""
    expected = {part: tensor_entries(value) for part, value in state.items()}

    def verify() -> CheckedFiles:
        checked = verify_files(checkpoint)
        check_state_matches(checkpoint, checked.metadata, expected)
        return checked

    return on_coordinator(verify, process_group, f"checking checkpoint {checkpoint}")


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

    DCP raises ``CheckpointException`` on every rank when any rank failed, with every failed
    rank's exception and traceback; the error keeps one line, the lowest failed rank's. Without
    a default process group it runs in this process alone, which is intended here, so its
    warning that it assumes so is silenced.
    """
    no_dist = not dist.is_initialized()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        try:
            operation(state, no_dist=no_dist, **kwargs)
        except CheckpointException as exc:
            raise CheckpointError(_one_line(what, exc.failures)) from exc


def _one_line(what: str, failures: dict[int, Any]) -> str:
    """``what`` failed, with the lowest failed rank's error: DCP gives ``(exception,
    traceback)`` per rank."""
    first, *others = sorted(failures)
    error = failures[first][0]
    detail = str(error) if isinstance(error, CheckpointError) else reason(error)
    also = f" (and on ranks {', '.join(map(str, others))})" if others else ""
    return f"{what} failed on rank {first}{also}: {detail}"


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The DCP state of ``model`` (and ``optimizer``), keyed by parameter name, unwrapped."""
    if optimizer is None:
        return {_MODEL: get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {_MODEL: model_state, _OPTIM: optim_state}
