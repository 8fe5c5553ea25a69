"""Checkpoints: resharding loads, crash safety, pruning, resume settings, errors on every rank.

A model trained one step with AdamW on a (dp=4, domain=2) mesh, under DDP or FSDP2 over dp,
is saved; the checkpoint is loaded on a (2, 1) mesh under DDP and FSDP2 and in one process
without a process group. Parameters and optimiser state must equal the saved ones, and one
more step on the same global batch must give the parameters of one more step on 8 ranks.
Crash safety is tested by SIGKILLing a saving process at each stage of the commit protocol.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardsci.checkpoint import (
    CheckpointError,
    _layout,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from shardsci.testing import (
    assert_all_ranks,
    assert_close_all_ranks,
    assert_raises_all_ranks,
    get_mesh,
    run_on_ranks,
)

BATCH, CHANNELS, LENGTH = 4, 3, 6
LR, WEIGHT_DECAY = 0.01, 0.1
Wrapped = tuple[nn.Module, torch.optim.Optimizer, int, int]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv1d(CHANNELS, 8, 3, padding=1, dtype=torch.float64),
        nn.GELU(),
        nn.Conv1d(8, 4, 3, padding=1, dtype=torch.float64),
        nn.Flatten(),
        nn.Linear(4 * LENGTH, 2, dtype=torch.float64),
    )


def _wrapped(wrapper: str, mesh_shape: tuple[int, int], seed: int, lr: float = LR) -> Wrapped:
    """A model, its AdamW, and this rank's dp coordinate and the dp size.

    ``wrapper`` is "ddp" or "fsdp2" over the dp axis of a (dp, domain) mesh, or "plain" for
    one process without a process group.
    """
    model = _model(seed)
    dp_rank, dp_size = 0, 1
    if wrapper != "plain":
        mesh = get_mesh(mesh_shape, ("dp", "domain"))
        dp_rank, dp_size = mesh.get_coordinate()[0], mesh.shape[0]
        if wrapper == "ddp":
            model = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
        else:
            model = fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    return model, optimizer, dp_rank, dp_size


def _train_step(wrapped: Wrapped, step: int) -> None:
    """One AdamW step on this dp rank's equal share of the global batch of ``step``."""
    model, optimizer, dp_rank, dp_size = wrapped
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(BATCH, CHANNELS, LENGTH, generator=generator, dtype=torch.float64)
    targets = torch.randn(BATCH, 2, generator=generator, dtype=torch.float64)
    share = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
    F.mse_loss(model(inputs[share]), targets[share]).backward()
    optimizer.step()
    optimizer.zero_grad()


def _full_state(wrapped: Wrapped) -> dict[str, torch.Tensor]:
    """Every unsharded parameter, optimiser-state tensor and hyperparameter, by name."""
    model, optimizer = wrapped[:2]
    options = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    flat = {f"model.{name}": value for name, value in model_state.items()}
    for name, entries in optim_state["state"].items():
        flat.update({f"optim.{name}.{key}": value for key, value in entries.items()})
    for index, group in enumerate(optim_state["param_groups"]):
        flat.update(
            {f"group{index}.{key}": torch.tensor(group[key]) for key in ("lr", "weight_decay")}
        )
    return {name: value.detach().clone() for name, value in flat.items()}


def _assert_states_close(
    actual: dict[str, torch.Tensor], expected: dict[str, Any], what: str, tolerance: float
) -> None:
    """Compare two ``_full_state``s, on every rank together when there is a process group."""
    tolerance = {"atol": tolerance, "rtol": tolerance}
    if not dist.is_initialized():
        assert actual.keys() == expected.keys(), what
        for name in expected:
            torch.testing.assert_close(
                actual[name], expected[name], **tolerance, msg=f"{what}: {name}"
            )
        return
    assert_all_ranks(
        actual.keys() == expected.keys(), f"{what}: {sorted(actual)} != {sorted(expected)}"
    )
    for name in expected:
        assert_close_all_ranks(actual[name], expected[name], **tolerance, what=f"{what}: {name}")


def _params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in state.items() if name.startswith("model.")}


# ---------------------------------------------------------------------------------------------
# Resharding: save on (4, 2), load on (2, 1) and in one process
# ---------------------------------------------------------------------------------------------


def _save_then_step(directory: str, wrapper: str) -> tuple[dict, dict] | None:
    wrapped = _wrapped(wrapper, (4, 2), seed=0)
    _train_step(wrapped, 1)
    save_checkpoint(directory, 1, *wrapped[:2], {"step": 1, "wrapper": wrapper})
    saved = _full_state(wrapped)
    _train_step(wrapped, 2)
    after = _full_state(wrapped)
    return (saved, _params(after)) if dist.get_rank() == 0 else None


def _load_then_step(checkpoint: Path, wrapper: str, saved: dict, after: dict) -> dict:
    # Another seed and learning rate: the checkpoint must restore both.
    wrapped = _wrapped(wrapper, (2, 1), seed=1, lr=10 * LR)
    extra = load_checkpoint(checkpoint, *wrapped[:2])
    _assert_states_close(_full_state(wrapped), saved, f"{wrapper} state after loading", 0.0)
    _train_step(wrapped, 2)
    # The global batch is split 4, 2 or 1 ways: gradients differ by rounding only.
    stepped = _params(_full_state(wrapped))
    _assert_states_close(stepped, after, f"{wrapper} one step after loading", 1e-12)
    return extra


@pytest.mark.parametrize("saved_with", ["ddp", "fsdp2"])
def test_checkpoint_from_4x2_loads_on_2x1_and_one_process(tmp_path: Path, saved_with: str) -> None:
    saved, after = run_on_ranks(8, _save_then_step, str(tmp_path), saved_with)[0]
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint == tmp_path / "step_000001"
    expected_extra = {"step": 1, "wrapper": saved_with}
    for wrapper in ("ddp", "fsdp2"):
        extras = run_on_ranks(2, _load_then_step, checkpoint, wrapper, saved, after)
        assert extras == [expected_extra] * 2
    assert _load_then_step(checkpoint, "plain", saved, after) == expected_extra


# ---------------------------------------------------------------------------------------------
# Crash safety: a saving process SIGKILLed at each stage of the commit protocol
# ---------------------------------------------------------------------------------------------


def _shifted_model(step: int) -> nn.Module:
    """The model state a run holds at ``step``: ``_model(0)`` with ``step`` added to every value."""
    model = _model(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(step)
    return model


def _kill_when(original: Callable[..., Any], should_die: Callable[..., bool]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if should_die(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    return wrapper


def _renamed_to(name: str) -> Callable[..., bool]:
    return lambda source, destination: Path(destination).name == name


class _KillPoint(NamedTuple):
    """Where to SIGKILL the save of step 2: when ``module.function`` is called with arguments
    that ``should_die`` accepts; and what the killed save must leave behind."""

    module: Any
    function: str
    should_die: Callable[..., bool]
    latest_step: int
    """The step ``latest_checkpoint`` must return after the kill."""
    left: list[str]
    """The directory's entries after the kill (a ``/`` names a file inside a directory)."""


_KILL_POINTS = {
    # DCP's fsync of the first shard it wrote: no .metadata yet.
    "writing_shards": _KillPoint(
        os, "fsync", lambda *args: True, 1, ["latest", "step_000001", "step_000002.tmp"]
    ),
    # Everything written and durable, the directory not yet renamed.
    "before_rename": _KillPoint(
        os,
        "rename",
        _renamed_to("step_000002"),
        1,
        ["latest", "step_000001", "step_000002.tmp", "step_000002.tmp/.metadata"],
    ),
    # step_000002 complete, `latest` still naming step_000001.
    "before_pointer": _KillPoint(
        os,
        "replace",
        _renamed_to("latest"),
        1,
        ["latest", "latest.tmp", "step_000001", "step_000002"],
    ),
    # `latest` names step_000002; step_000001 renamed for deletion, its deletion cut short.
    "pruning": _KillPoint(
        shutil, "rmtree", lambda *args: True, 2, ["latest", "step_000001.trash", "step_000002"]
    ),
}


def _save_twice_dying(directory: str, point: str) -> None:
    """Save steps 1 and 2 (keep_last=1), SIGKILLing this process at ``point`` of the second."""
    torch.set_num_threads(1)
    save_checkpoint(directory, 1, _shifted_model(1), None, {"step": 1}, keep_last=1)
    kill = _KILL_POINTS[point]
    original = getattr(kill.module, kill.function)
    setattr(kill.module, kill.function, _kill_when(original, kill.should_die))
    save_checkpoint(directory, 2, _shifted_model(2), None, {"step": 2}, keep_last=1)


def _entries(directory: Path, expected: list[str]) -> list[str]:
    """The names of ``directory``'s entries, and of those paths in ``expected`` that exist."""
    names = [entry.name for entry in directory.iterdir()]
    return sorted(
        names + [name for name in expected if "/" in name and (directory / name).exists()]
    )


def test_save_killed_at_any_stage_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    context = multiprocessing.get_context("forkserver")
    writers = {
        point: context.Process(target=_save_twice_dying, args=(str(tmp_path / point), point))
        for point in _KILL_POINTS
    }
    for writer in writers.values():
        writer.start()
    for point, writer in writers.items():
        writer.join(60)
        assert writer.exitcode == -signal.SIGKILL, f"{point}: exit code {writer.exitcode}"
    for point, kill in _KILL_POINTS.items():
        directory = tmp_path / point
        assert _entries(directory, kill.left) == kill.left, point
        checkpoint = latest_checkpoint(directory)
        assert checkpoint == directory / f"step_{kill.latest_step:06d}", point
        model = _model(seed=5)
        assert load_checkpoint(checkpoint, model, None) == {"step": kill.latest_step}
        for loaded, expected in zip(
            model.parameters(), _shifted_model(kill.latest_step).parameters()
        ):
            torch.testing.assert_close(loaded, expected, atol=0, rtol=0)
        # The next save (of step 2 again) cleans up whatever the killed one left.
        save_checkpoint(directory, 2, _shifted_model(2), None, {"redone": True}, keep_last=1)
        assert sorted(entry.name for entry in directory.iterdir()) == ["latest", "step_000002"]
        assert load_checkpoint(latest_checkpoint(directory), model, None) == {"redone": True}


# ---------------------------------------------------------------------------------------------
# Pruning, resume settings, the directory layout (one process)
# ---------------------------------------------------------------------------------------------


def _save_steps(directory: Path, steps: list[int], keep_last: int | None) -> None:
    for step in steps:
        save_checkpoint(
            directory, step, _shifted_model(step), None, {"step": step}, keep_last=keep_last
        )


def _steps_on_disk(directory: Path) -> list[int]:
    return sorted(
        int(m.group(1)) for e in directory.iterdir() if (m := re.fullmatch(r"step_(\d+)", e.name))
    )


def test_keep_last_prunes_only_older_checkpoints(tmp_path: Path) -> None:
    _save_steps(tmp_path / "two", [10, 20, 30, 40], keep_last=2)
    assert _steps_on_disk(tmp_path / "two") == [30, 40]
    _save_steps(tmp_path / "all", [1, 2, 3], keep_last=None)
    assert _steps_on_disk(tmp_path / "all") == [1, 2, 3]
    # A run rolled back to step 20 and saving step 25 keeps the abandoned step 40.
    _save_steps(tmp_path / "two", [25], keep_last=2)
    assert _steps_on_disk(tmp_path / "two") == [25, 30, 40]
    assert latest_checkpoint(tmp_path / "two") == tmp_path / "two" / "step_000025"
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        _save_steps(tmp_path / "two", [50], keep_last=0)


def test_latest_falls_back_to_newest_complete_checkpoint(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    _save_steps(tmp_path, [1, 2], keep_last=None)
    (tmp_path / "step_000003.tmp").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    (tmp_path / "latest").write_text("step_000009\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"


def test_resolve_resume(tmp_path: Path) -> None:
    assert resolve_resume(tmp_path, "auto") is None
    _save_steps(tmp_path, [3, 7], keep_last=None)
    assert resolve_resume(tmp_path, "auto") == tmp_path / "step_000007"
    assert resolve_resume(tmp_path, "never") is None
    assert resolve_resume(tmp_path, None) is None
    assert resolve_resume(tmp_path, str(tmp_path / "step_000003")) == tmp_path / "step_000003"
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume(tmp_path, tmp_path / "step_000005")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_resume(tmp_path, tmp_path)
    (tmp_path / "step_000008.tmp").mkdir()
    with pytest.raises(CheckpointError, match="unfinished save"):
        resolve_resume(tmp_path, tmp_path / "step_000008.tmp")


# ---------------------------------------------------------------------------------------------
# Errors are raised on every rank
# ---------------------------------------------------------------------------------------------


def _errors_on_every_rank(directory: str) -> None:
    model, optimizer, *_ = wrapped = _wrapped("ddp", (2, 1), seed=0)
    _train_step(wrapped, 1)
    save_checkpoint(directory, 1, model, optimizer, {"step": 1})
    checkpoint = Path(directory) / "step_000001"

    assert_raises_all_ranks(
        CheckpointError, "not a complete checkpoint", load_checkpoint, directory, model, optimizer
    )
    other = nn.Sequential(nn.Conv1d(CHANNELS, 5, 3, dtype=torch.float64))
    assert_raises_all_ranks(
        CheckpointError,
        r"does not match the model: unexpected 2\.bias, .*0\.bias is \(8,\)",
        load_checkpoint,
        checkpoint,
        other,
        None,
    )
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    assert_raises_all_ranks(
        CheckpointError,
        r"does not match the optimiser: missing state\.0\.bias\.momentum_buffer, .*"
        r"unexpected state\.0\.bias\.exp_avg",
        load_checkpoint,
        checkpoint,
        model,
        sgd,
    )
    assert_raises_all_ranks(
        CheckpointError,
        "extra must hold only tensors and plain values",
        save_checkpoint,
        directory,
        2,
        model,
        optimizer,
        {"f": lambda: 0},
    )

    # Rank 0 fails while committing step 3: every rank raises; step 1 stays the latest.
    with mock.patch.object(_layout, "_replace_latest", side_effect=OSError("disk full")):
        assert_raises_all_ranks(
            CheckpointError,
            "committing .* OSError: disk full",
            save_checkpoint,
            directory,
            3,
            model,
            optimizer,
        )
    assert_all_ranks(
        latest_checkpoint(directory) == checkpoint, f"latest is {latest_checkpoint(directory)}"
    )
    assert_all_ranks(load_checkpoint(checkpoint, model, optimizer) == {"step": 1})


def test_errors_are_raised_on_every_rank(tmp_path: Path) -> None:
    run_on_ranks(2, _errors_on_every_rank, str(tmp_path))
