"""Checkpoints someone else wrote: loading one runs no code, and a bad one is refused in one line.

A real checkpoint is saved on 2 ranks (FSDP2, AdamW after a step); copies of it are then
planted with pickles whose unpickling creates a marker file, one copy per file of the
checkpoint (and per kind of entry in a shard: tensors, plain values), or damaged (a shard
truncated, missing or overwritten, ``.metadata`` or ``extra.pt`` cut short), or loaded into
another model. Every load must be refused on every rank, in one process and on 2 ranks, with
one line naming the file, and no marker may appear (NOTE [What a checkpoint may hold]).
"""

from __future__ import annotations

import io
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path, PosixPath
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)

from shardsci.checkpoint import (
    CheckpointError,
    check_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from shardsci.checkpoint import _metadata as _metadata_module
from shardsci.checkpoint._metadata import METADATA_GLOBALS
from shardsci.models import MeshGraphNet
from shardsci.testing import assert_all_ranks, assert_raises_all_ranks, run_on_ranks
from shardsci.training import ScheduleConfig, warmup_cosine
from tests.test_checkpoint import (
    CHANNELS,
    LR,
    Wrapped,
    _assert_states_close,
    _full_state,
    _train_step,
    _wrapped,
)
from tests.zoo import MODELS

STEP = 1
Damage = Callable[[Path], None]


class _CreatesFile:
    """Unpickled, it opens ``path`` for writing: a stand-in for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _save(directory: str) -> None:
    wrapped = _wrapped("fsdp2", (2, 1), seed=0)
    _train_step(wrapped, STEP)
    save_checkpoint(directory, STEP, *wrapped[:2], {"step": STEP})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint of 2 FSDP2 ranks: ``.metadata``, ``extra.pt``, two shard files."""
    directory = tmp_path_factory.mktemp("saved")
    run_on_ranks(2, _save, str(directory))
    return directory / f"step_{STEP:06d}"


def _metadata(checkpoint: Path) -> Metadata:
    # Written by this test's own save: trusted.
    return pickle.loads((checkpoint / ".metadata").read_bytes())


def _write_metadata(checkpoint: Path, metadata: Metadata) -> None:
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


def _copy(checkpoint: Path, destination: Path, damage: Damage) -> Path:
    shutil.copytree(checkpoint, destination)
    damage(destination)
    return destination


# ---------------------------------------------------------------------------------------------
# Planted pickles: one copy per file of the checkpoint and per kind of shard entry
# ---------------------------------------------------------------------------------------------


def _plant_in_metadata(marker: Path) -> Damage:
    def plant(checkpoint: Path) -> None:
        metadata = _metadata(checkpoint)
        metadata.version = _CreatesFile(marker)  # genuine metadata around it
        _write_metadata(checkpoint, metadata)

    return plant


def _plant_in_extra(marker: Path) -> Damage:
    def plant(checkpoint: Path) -> None:
        torch.save({"step": STEP, "extra": {"rng": _CreatesFile(marker)}}, checkpoint / "extra.pt")

    return plant


def _plant_in_shard(marker: Path, shard: str, kind: type) -> Damage:
    """Replace every entry of ``kind`` stored in ``shard`` by a pickle (written the way DCP
    writes an entry, with ``torch.save``) and move the others, so that ``.metadata`` lists
    each entry at its new place: a consistent checkpoint, crafted."""

    def plant(checkpoint: Path) -> None:
        metadata, old = _metadata(checkpoint), (checkpoint / shard).read_bytes()
        payload = io.BytesIO()
        torch.save(_CreatesFile(marker), payload)
        new = bytearray()
        stored = [(i, s) for i, s in metadata.storage_data.items() if s.relative_path == shard]
        for index, info in sorted(stored, key=lambda item: item[1].offset):
            entry = metadata.state_dict_metadata[index.fqn]
            data = (
                payload.getvalue()
                if isinstance(entry, kind)
                else old[info.offset : info.offset + info.length]
            )
            info.offset, info.length = len(new), len(data)
            new += data
        (checkpoint / shard).write_bytes(bytes(new))
        _write_metadata(checkpoint, metadata)

    return plant


def _planted_copies(checkpoint: Path, root: Path) -> dict[str, tuple[Path, Path, str]]:
    """Per target: the planted copy, its marker, and the file the refusal must name."""
    targets: dict[str, tuple[Damage, Path, str]] = {}
    for name, plant in (("metadata", _plant_in_metadata), ("extra", _plant_in_extra)):
        marker = root / f"ran-{name}"
        targets[name] = (plant(marker), marker, ".metadata" if name == "metadata" else "extra.pt")
    metadata = _metadata(checkpoint)
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        kind = "tensors" if isinstance(entry, TensorStorageMetadata) else "values"
        target = f"{info.relative_path}-{kind}"
        if target not in targets:
            marker = root / f"ran-{target}"
            plant = _plant_in_shard(marker, info.relative_path, type(entry))
            targets[target] = (plant, marker, info.relative_path)
    return {
        target: (_copy(checkpoint, root / target, plant), marker, file)
        for target, (plant, marker, file) in targets.items()
    }


def _outcome(load: Callable[[], Any]) -> str:
    try:
        load()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def _load_planted_on_ranks(copies: dict[str, Path]) -> dict[str, str]:
    model, optimizer, *_ = _wrapped("ddp", (2, 1), seed=1)
    outcomes = {}
    for target, path in copies.items():
        outcomes[target] = _outcome(lambda path=path: load_checkpoint(path, model, optimizer))
        # Every rank refused (or not) at the same point: agree before the next load.
        assert_all_ranks(True)
    return outcomes


def _assert_none_ran(planted: dict[str, tuple[Path, Path, str]], where: str) -> None:
    ran = [target for target, (_, marker, _) in planted.items() if marker.exists()]
    assert not ran, f"a planted pickle ran while loading {ran} {where}"


def test_planted_pickles_in_any_file_run_nothing(checkpoint: Path, tmp_path: Path) -> None:
    planted = _planted_copies(checkpoint, tmp_path)
    # Every file of the checkpoint, and both kinds of shard entry, are planted.
    assert {file for _, _, file in planted.values()} == {p.name for p in checkpoint.iterdir()}
    assert {target.rsplit("-", 1)[-1] for target in planted} >= {"tensors", "values"}
    model, optimizer, *_ = _wrapped("plain", (1, 1), seed=1)
    single = {
        target: _outcome(lambda path=path: load_checkpoint(path, model, optimizer))
        for target, (path, _, _) in planted.items()
    }
    _assert_none_ran(planted, "in one process")
    ranks = run_on_ranks(2, _load_planted_on_ranks, {t: p for t, (p, _, _) in planted.items()})
    _assert_none_ran(planted, "on 2 ranks")
    for target, (path, _, file) in planted.items():
        expected = (
            rf"^CheckpointError: [^\n]*checkpoint file {path / file} [^\n]*"
            rf"pickled io\.open[^\n]*$"
        )
        for where, outcome in [("one process", single[target])] + [
            (f"rank {rank}", outcomes[target]) for rank, outcomes in enumerate(ranks)
        ]:
            assert re.search(expected, outcome), f"{target} on {where}: {outcome}"


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints and checkpoints of another model
# ---------------------------------------------------------------------------------------------


def _largest_shard(checkpoint: Path) -> str:
    shards = [p for p in checkpoint.iterdir() if p.suffix == ".distcp"]
    return max(shards, key=lambda p: p.stat().st_size).name


def _cut(name: str, keep: Callable[[int], int]) -> Damage:
    def cut(checkpoint: Path) -> None:
        data = (checkpoint / name).read_bytes()
        (checkpoint / name).write_bytes(data[: keep(len(data))])

    return cut


def _delete(name: str) -> Damage:
    return lambda checkpoint: (checkpoint / name).unlink()


def _zero_a_tensor_in(shard: str) -> Damage:
    """Overwrite one tensor entry of ``shard`` with zeros: same size, unreadable contents."""

    def zero(checkpoint: Path) -> None:
        metadata = _metadata(checkpoint)
        info = next(
            info
            for index, info in metadata.storage_data.items()
            if info.relative_path == shard
            and isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata)
        )
        data = bytearray((checkpoint / shard).read_bytes())
        data[info.offset : info.offset + info.length] = bytes(info.length)
        (checkpoint / shard).write_bytes(bytes(data))

    return zero


def _point_outside(checkpoint: Path) -> None:
    """A crafted ``.metadata`` that sends a read outside the checkpoint directory."""
    metadata = _metadata(checkpoint)
    next(iter(metadata.storage_data.values())).relative_path = "../extra.pt"
    _write_metadata(checkpoint, metadata)


def _damaged(checkpoint: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Per case: the damaged copy, and the pattern its refusal must match."""
    shard = _largest_shard(checkpoint)
    cases: dict[str, tuple[Damage, str]] = {
        "shard truncated": (
            _cut(shard, lambda n: n - 100),
            rf"{shard} is truncated: \d+ bytes, expected at least \d+ \(its \.metadata stores ",
        ),
        "shard missing": (
            _delete(shard),
            rf"{shard} is missing; its \.metadata stores .* in it",
        ),
        ".metadata truncated": (
            _cut(".metadata", lambda n: n // 2),
            r"\.metadata cannot be read: .*; expected DCP metadata as save_checkpoint writes it",
        ),
        ".metadata pointing outside": (
            _point_outside,
            r"\.metadata is not DCP metadata .*: entry .*: its data is in '\.\./extra\.pt'; "
            r"expected a shard file",
        ),
        "extra.pt truncated": (
            _cut("extra.pt", lambda n: n - 10),
            r"extra\.pt cannot be read: .*; expected the step and extra that save_checkpoint",
        ),
        ".metadata missing": (_delete(".metadata"), r"is not a complete checkpoint: it lacks"),
    }
    return {
        case: (_copy(checkpoint, root / case.replace(" ", "-"), damage), pattern)
        for case, (damage, pattern) in cases.items()
    }


def _other_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Conv1d(CHANNELS, 5, 3, dtype=torch.float64))
    return model, torch.optim.AdamW(model.parameters())


_OTHER_MODEL = (
    r"does not match the model: unexpected 2\.bias, .*; 0\.bias is \(8,\) in the checkpoint, "
    r"\(5,\) in the model"
)


def _refused_in_one_line(pattern: str, load: Callable[..., Any], *args: Any) -> None:
    error = assert_raises_all_ranks(CheckpointError, pattern, load, *args)
    assert_all_ranks("\n" not in str(error), f"not one line: {error}")


def _load_damaged_on_ranks(
    checkpoint: Path, damaged: dict[str, tuple[Path, str]], unreadable: Path
) -> None:
    # FSDP2 on 2 ranks: each rank reads only the chunks it holds, so a shard entry only one
    # rank reads fails there, and the other rank must raise too.
    model, optimizer, *_ = _wrapped("fsdp2", (2, 1), seed=1)
    for path, pattern in damaged.values():
        _refused_in_one_line(pattern, load_checkpoint, path, model, optimizer)
    _refused_in_one_line(
        rf"reading checkpoint {unreadable} failed on rank \d: checkpoint file {unreadable}/"
        r"__\d_0\.distcp cannot be read: \w+Error: .*; expected the tensors",
        load_checkpoint,
        unreadable,
        model,
        optimizer,
    )
    other, other_optimizer = _other_model()
    _refused_in_one_line(_OTHER_MODEL, load_checkpoint, checkpoint, other, other_optimizer)
    _refused_in_one_line(_OTHER_MODEL, check_checkpoint, checkpoint, other)


def test_damaged_checkpoints_and_other_models_are_refused_in_one_line_on_every_rank(
    checkpoint: Path, tmp_path: Path
) -> None:
    damaged = _damaged(checkpoint, tmp_path)
    unreadable = _copy(checkpoint, tmp_path / "unreadable", _zero_a_tensor_in("__1_0.distcp"))
    # Refused before any rank starts: what `train.resume=<path>` checks.
    for path, pattern in damaged.values():
        with pytest.raises(CheckpointError, match=pattern):
            resolve_resume(tmp_path, path)
    assert resolve_resume(tmp_path, unreadable) == unreadable  # its shards are not read here
    model, optimizer, *_ = _wrapped("plain", (1, 1), seed=1)
    weights_only = save_checkpoint(tmp_path / "weights", STEP, model, None)
    with pytest.raises(CheckpointError, match="holds no state of the optimiser: it was saved"):
        load_checkpoint(weights_only, model, optimizer)
    run_on_ranks(2, _load_damaged_on_ranks, checkpoint, damaged, unreadable)


# ---------------------------------------------------------------------------------------------
# extra: plain values only; a stored config is data
# ---------------------------------------------------------------------------------------------


def test_extra_holds_plain_values_and_a_stored_config_stays_data(tmp_path: Path) -> None:
    model, optimizer, *_ = _wrapped("plain", (1, 1), seed=0)
    legacy = np.random.RandomState(7)
    with pytest.raises(
        CheckpointError, match=r"extra must hold only .*numpy.*; convert numpy arrays to tensors"
    ):
        save_checkpoint(tmp_path, STEP, model, None, {"rng": legacy.get_state()})
    assert not tmp_path.joinpath(f"step_{STEP:06d}").exists()

    # numpy's RNG states as tensors and ints, and a config naming code to run.
    name, keys, position, has_gauss, cached = legacy.get_state()
    generator = np.random.default_rng(7)
    marker = tmp_path / "instantiated"
    config = {"model": {"_target_": "builtins.open", "_args_": [str(marker), "w"]}}
    extra = {
        "legacy_rng": (name, torch.from_numpy(keys), position, has_gauss, cached),
        "rng": generator.bit_generator.state,
        "config": config,
    }
    save_checkpoint(tmp_path, STEP, model, optimizer, extra)
    expected_draws = (legacy.standard_normal(3), generator.standard_normal(3))
    loaded = load_checkpoint(tmp_path / f"step_{STEP:06d}", model, optimizer)
    restored = np.random.RandomState()
    name, keys, position, has_gauss, cached = loaded["legacy_rng"]
    restored.set_state((name, keys.numpy(), position, has_gauss, cached))
    resumed = np.random.default_rng()
    resumed.bit_generator.state = loaded["rng"]
    np.testing.assert_array_equal(restored.standard_normal(3), expected_draws[0])
    np.testing.assert_array_equal(resumed.standard_normal(3), expected_draws[1])
    assert loaded["config"] == config and type(loaded["config"]) is dict
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# The allowlist of DCP's metadata
# ---------------------------------------------------------------------------------------------


def _global(module: str, name: str) -> Any:
    """What ``.metadata`` holding only a reference to ``module.name`` unpickles to."""
    data = io.BytesIO(f"c{module}\n{name}\n.".encode())
    return _metadata_module._MetadataUnpickler(data).load()


def test_every_allowed_name_resolves_and_nothing_else_does() -> None:
    for module, names in METADATA_GLOBALS.items():
        for name in names:
            assert _global(module, name) is not None, f"{module}.{name}"
    assert _global("pathlib._local", "PosixPath") is PosixPath  # as Python 3.13 pickles it
    assert _global("torch", "float64") is torch.float64
    for module, name in [("torch", "load"), ("builtins", "eval"), ("os", "system")]:
        with pytest.raises(pickle.UnpicklingError, match=rf"{module}\.{name}"):
            _global(module, name)


# ---------------------------------------------------------------------------------------------
# Real checkpoints still load: every zoo model, and one written before the allowlists
# ---------------------------------------------------------------------------------------------


ZOO = [*MODELS, "meshgraphnet"]


def _zoo(seed: int) -> Wrapped:
    """Every zoo model, small, in one module, and its AdamW after one step on gradients
    ``parameters / 2``: one checkpoint holds each model's entries as its own checkpoint would
    (under the model's name), at the cost of one save and one load."""
    torch.manual_seed(seed)
    models = {name: factory() for name, factory in MODELS.items()}
    models["meshgraphnet"] = MeshGraphNet(
        node_in=6, edge_in=3, node_out=2, hidden=8, processor_blocks=2
    )
    zoo = nn.ModuleDict(models)
    optimizer = torch.optim.AdamW(zoo.parameters(), lr=LR)
    for parameter in zoo.parameters():
        parameter.grad = parameter.detach() / 2
    optimizer.step()
    return zoo, optimizer, 0, 1


def _save_zoo(directory: str) -> None:
    # Replicated on both ranks, as over a domain axis: DCP writes each entry once, from
    # either rank, into that rank's shard file.
    save_checkpoint(directory, STEP, *_zoo(seed=3)[:2], {"step": STEP})


def test_every_zoo_model_loads_on_another_mesh(tmp_path: Path) -> None:
    run_on_ranks(2, _save_zoo, str(tmp_path))
    checkpoint = tmp_path / f"step_{STEP:06d}"
    assert len(list(checkpoint.glob("*.distcp"))) == 2
    expected = _full_state(_zoo(seed=3))
    assert {name.split(".")[1] for name in expected if name.startswith("model.")} == set(ZOO)
    model, optimizer, *_ = loaded = _zoo(seed=4)
    assert load_checkpoint(checkpoint, model, optimizer) == {"step": STEP}
    _assert_states_close(_full_state(loaded), expected, "zoo", 0.0)


BEFORE = Path(__file__).parent / "data" / "checkpoint_f74f112"
"""A checkpoint written by ``save_checkpoint`` at commit f74f112, before the allowlists, as the
trainer wrote them (step and scheduler state in ``extra``): ``_wrapped("plain", (1, 1),
seed=0)``, ``warmup_cosine(optimizer, ScheduleConfig(), 10)``, ``_train_step(wrapped, 1)``,
one scheduler step, then ``save_checkpoint(directory, 1, model, optimizer, {"step": 1,
"scheduler": scheduler.state_dict()})``."""


def _stored_state(directory: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """What a checkpoint holds, read by torch's own converter rather than ``load_checkpoint``,
    named as ``_full_state`` names it."""
    dcp_to_torch_save(directory, scratch / "stored.pt")
    stored = torch.load(scratch / "stored.pt", weights_only=False)  # our own test data
    flat = {f"model.{name}": value for name, value in stored["model"].items()}
    for name, entries in stored["optim"]["state"].items():
        flat.update({f"optim.{name}.{key}": value for key, value in entries.items()})
    for index, group in enumerate(stored["optim"]["param_groups"]):
        flat.update(
            {f"group{index}.{key}": torch.tensor(group[key]) for key in ("lr", "weight_decay")}
        )
    return flat


def test_a_checkpoint_written_before_the_allowlists_loads_bit_for_bit(tmp_path: Path) -> None:
    model, optimizer, *_ = loaded = _wrapped("plain", (1, 1), seed=1, lr=10 * LR)
    extra = load_checkpoint(BEFORE, model, optimizer)
    _assert_states_close(_full_state(loaded), _stored_state(BEFORE, tmp_path), "before", 0.0)
    # It is the state its docstring says, recomputed here to float64 rounding only: the stored
    # step ran on another CPU, whose kernels may sum in another order (AVX2 against AVX-512).
    wrapped = _wrapped("plain", (1, 1), seed=0)
    scheduler = warmup_cosine(wrapped[1], ScheduleConfig(), 10)
    _train_step(wrapped, 1)
    scheduler.step()
    assert extra == {"step": 1, "scheduler": scheduler.state_dict()}
    _assert_states_close(_full_state(loaded), _full_state(wrapped), "before, recomputed", 1e-12)
