"""Sharded HDF5 output (``shardsci.data.ShardedHDF5Writer``): a field written block by block
from every rank is, byte for byte, the file a single process writes of the same array, and
plain h5py reads it whole; on 1-D, 2x2 and 2x2x2 meshes with uneven, empty, replicated and
nested shards; no rank receives or converts more than its own block; bad output is refused on
every rank before anything is written."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import ShardTensorSpec
from shardsci.data import ShardedHDF5Field, ShardedHDF5Writer, _writer, write_sharded_hdf5
from shardsci.tensor._api import from_local_spec
from shardsci.testing import (
    assert_all_ranks,
    assert_raises_all_ranks,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

ATTRIBUTES = {
    "model": "fno3d",
    "checkpoint": "runs/a/step_100.pt",
    "resolution": 6,
    "mesh": "2x2x2",
}

# name -> (mesh shape, placements, shard sizes) of one step (B, C, D, H, W) = (2, 2, 9, 6, 5).
STEP_SHAPE = (2, 2, 9, 6, 5)
CASES = {
    "4 ranks, D 4/0/3/2": ((4,), (Shard(2),), {2: (4, 0, 3, 2)}),
    "4 ranks, W 0/5/0/0": ((4,), (Shard(4),), {4: (0, 5, 0, 0)}),
    "2x2, D 9/0 x H 2/4": ((2, 2), (Shard(2), Shard(3)), {2: (9, 0), 3: (2, 4)}),
    "2x2, replicated x W 3/2": ((2, 2), (Replicate(), Shard(4)), {4: (3, 2)}),
    "2x2, H nested 1/0/3/2": ((2, 2), (Shard(3), Shard(3)), {3: (1, 0, 3, 2)}),
    "2x2x2, D 5/4 x H 6/0 x W 2/3": (
        (2, 2, 2),
        (Shard(2), Shard(3), Shard(4)),
        {2: (5, 4), 3: (6, 0), 4: (2, 3)},
    ),
    "2x2x2, B 1/1 x H 3/3 x W 4/1": (
        (2, 2, 2),
        (Shard(0), Shard(3), Shard(4)),
        {0: (1, 1), 3: (3, 3), 4: (4, 1)},
    ),
}
STEPS = 3


def _steps() -> torch.Tensor:
    """The rollout every rank (and the reference) writes, ``(STEPS, *STEP_SHAPE)``."""
    generator = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, *STEP_SHAPE, generator=generator, dtype=torch.float64)


def _reference_file(path: Path) -> Path:
    """The same rollout written by one process, step by step."""
    with ShardedHDF5Writer.create(
        path, "prediction", (STEPS, *STEP_SHAPE), torch.float32, ATTRIBUTES
    ) as writer:
        for step in _steps():
            writer.append(step)
    return path


def _data_bytes(path: Path, name: str) -> bytes:
    """The raw bytes of a contiguous dataset, read from the file (not through HDF5)."""
    with h5py.File(path, "r") as file:
        dataset = file[name]
        offset, size = dataset.id.get_offset(), dataset.id.get_storage_size()
    with open(path, "rb") as raw:
        raw.seek(offset)
        return raw.read(size)


def _rollout_body(name: str, directory: str) -> None:
    mesh_shape, placements, sizes = CASES[name]
    mesh = get_mesh(mesh_shape)
    path = Path(directory) / "sharded.h5"
    steps = _steps()
    spec = ShardTensorSpec.build(mesh, placements, STEP_SHAPE, torch.float64, sizes)
    converted: list[int] = []
    original = _writer.ShardedHDF5Writer._write_block

    def recording(self, array, offsets):  # what each rank turns into bytes
        converted.append(array.size)
        return original(self, array, offsets)

    _writer.ShardedHDF5Writer._write_block = recording
    try:
        writer = ShardedHDF5Writer.create(
            path, "prediction", (STEPS, *STEP_SHAPE), torch.float32, ATTRIBUTES, mesh
        )
        with count_traffic() as traffic:
            for step in steps:
                writer.append(from_local_spec(spec.narrow(step).clone(), spec))
        writer.close()
    finally:
        _writer.ShardedHDF5Writer._write_block = original
    local = spec.local_shape().numel()
    assert_all_ranks(
        traffic.received == 0 and traffic.sent == 0, f"{name}: writing moved {traffic}"
    )
    assert_all_ranks(
        all(size == local for size in converted) and len(converted) in (0, STEPS),
        f"{name}: converted blocks of {converted} elements, the local block has {local}",
    )
    # Each block is written once: the ranks that wrote hold disjoint blocks covering the field.
    written = torch.tensor([len(converted) and local], dtype=torch.int64)
    torch.distributed.all_reduce(written)
    whole = int(np.prod(STEP_SHAPE))
    assert_all_ranks(int(written) == whole, f"{name}: ranks wrote {int(written)} of {whole}")

    # Read back by shardsci's reader, each rank its own slab of every step.
    shard_dims = {axis: p.dim + 1 for axis, p in enumerate(placements) if isinstance(p, Shard)}
    if all(dim >= 3 for dim in shard_dims.values()) and len(set(shard_dims.values())) == len(
        shard_dims
    ):
        field = ShardedHDF5Field(
            path,
            "prediction",
            mesh,
            shard_dims,
            index_dims=3,
            sizes={d + 1: s for d, s in sizes.items()},
            dtype=torch.float64,
        )
        read = field.read([(t, b, c) for t in range(STEPS) for b in range(2) for c in range(2)])
        expected = steps.float().double().reshape(-1, *STEP_SHAPE[2:])
        mine = read.spec.narrow(expected)
        assert_all_ranks(torch.equal(read.to_local(), mine), f"{name}: read back differs")
        field.close()


@pytest.mark.parametrize("name", list(CASES))
def test_rollout_is_the_single_process_file(name: str, tmp_path: Path) -> None:
    world = int(np.prod(CASES[name][0]))
    run_on_ranks(world, _rollout_body, name, str(tmp_path))
    sharded = tmp_path / "sharded.h5"
    reference = _reference_file(tmp_path / "reference.h5")
    assert (
        _data_bytes(sharded, "prediction")
        == np.ascontiguousarray(_steps().float().numpy()).astype("<f4").tobytes()
    )
    assert sharded.read_bytes() == reference.read_bytes()
    with h5py.File(sharded, "r") as file:
        np.testing.assert_array_equal(file["prediction"][:], _steps().float().numpy())
        np.testing.assert_array_equal(
            file["prediction"][1, :, 1, 2:7], _steps()[1, :, 1, 2:7].float()
        )
        assert file.attrs["model"] == "fno3d" and file.attrs["resolution"] == 6
        assert file.attrs["mesh"] == "2x2x2"
        assert file["prediction"].attrs["complete"]
        assert file["prediction"].attrs["steps_written"] == STEPS


def test_single_process_file_is_plain_hdf5(tmp_path: Path) -> None:
    """The one-process write against h5py's own write of the same array."""
    steps = _steps().float()
    ours = write_sharded_hdf5(tmp_path / "ours.h5", "field", steps, ATTRIBUTES)
    with h5py.File(tmp_path / "h5py.h5", "w") as file:
        file.create_dataset("field", data=steps.numpy())
    assert _data_bytes(ours, "field") == _data_bytes(tmp_path / "h5py.h5", "field")
    with h5py.File(ours, "r") as file:
        assert file["field"].dtype == np.float32 and file["field"].chunks is None
        assert file["field"].attrs["complete"] and file.attrs["checkpoint"] == "runs/a/step_100.pt"


def _refusal_body(directory: str) -> None:
    mesh = get_mesh((2, 2))
    existing = Path(directory) / "existing.h5"
    before = existing.read_bytes()
    assert_raises_all_ranks(
        FileExistsError,
        "refusing to write .*existing.h5: it exists",
        lambda: ShardedHDF5Writer.create(existing, "p", (2, 3), torch.float32, {}, mesh),
    )
    assert_all_ranks(existing.read_bytes() == before, "the existing file was modified")
    fresh = Path(directory) / "fresh.h5"
    assert_raises_all_ranks(
        TypeError,
        "attribute 'config' = .* cannot be stored in HDF5",
        lambda: ShardedHDF5Writer.create(fresh, "p", (2,), torch.float32, {"config": {}}, mesh),
    )
    assert_raises_all_ranks(
        TypeError,
        "cannot store torch.bfloat16",
        lambda: ShardedHDF5Writer.create(fresh, "p", (2,), torch.bfloat16, {}, mesh),
    )
    assert_all_ranks(not fresh.exists(), "a refused output was created")


def test_existing_path_and_bad_attributes_are_refused_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "existing.h5").write_bytes(b"the user's file")
    run_on_ranks(4, _refusal_body, str(tmp_path))


def _partial_body(directory: str) -> None:
    """A Partial field is reduced (an all-reduce of the local block) before it is written."""
    mesh = get_mesh((2, 2))
    x = torch.randn(4, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    spec = ShardTensorSpec.build(mesh, (Shard(1), Shard(2)), x.shape, x.dtype, {1: (4, 2)})
    summed = from_local_spec(spec.narrow(x).clone(), spec).sum(dim=1)  # (4, 5)
    assert_all_ranks(summed.spec.partial, f"expected a Partial sum, got {summed.spec}")
    path = Path(directory) / "partial.h5"
    write_sharded_hdf5(path, "s", summed)
    with h5py.File(path, "r") as file:
        ok = np.allclose(file["s"][:], x.sum(1).numpy(), rtol=0, atol=1e-12)
    assert_all_ranks(ok, f"a reduced field was written wrong ({summed.spec})")


def test_partial_fields_are_reduced_first(tmp_path: Path) -> None:
    run_on_ranks(4, _partial_body, str(tmp_path))


def test_writes_check_their_selection_and_a_failure_leaves_the_file_incomplete(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rollout.h5"
    failing = pytest.raises(RuntimeError, match="diverged")
    with failing, ShardedHDF5Writer.create(path, "p", (2, 3), torch.float64) as writer:
        writer.append(torch.ones(3))
        with pytest.raises(ValueError, match=r"a field of shape \(4,\) cannot fill"):
            writer.append(torch.ones(4))
        writer.append(torch.ones(3))
        with pytest.raises(IndexError, match="all 2 steps of p are written"):
            writer.append(torch.ones(3))
        raise RuntimeError("the model diverged")
    with h5py.File(path, "r") as file:
        assert not file["p"].attrs["complete"]
        np.testing.assert_array_equal(file["p"][:], np.ones((2, 3)))
    with ShardedHDF5Writer.create(tmp_path / "slab.h5", "p", (2, 4, 3), torch.float32) as writer:
        writer.write(torch.full((2, 3), 5.0), (1, slice(1, 3)))
    with h5py.File(tmp_path / "slab.h5", "r") as file:
        expected = np.zeros((2, 4, 3), np.float32)
        expected[1, 1:3] = 5
        np.testing.assert_array_equal(file["p"][:], expected)
