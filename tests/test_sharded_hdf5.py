"""shardsci.data: every rank reads only its slab of an HDF5 field, statistics without
gathering, and the shuffled, resumable next-step batches split over data-parallel ranks.

The proof that a rank reads only its slab watches the file itself: the field opens the file
through a recording file object, and every byte range h5py asks for is mapped back to the
storage units of the dataset it covers (single elements for a contiguous dataset, chunks for
a chunked one). The units a rank touched must be exactly those that hold its slab of the
samples it asked for, each read once.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from itertools import product

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from shardsci import ShardTensor
from shardsci.data import HDF5Source, NextStepPairs, ShardedHDF5Field
from shardsci.data._hdf5 import index_runs
from shardsci.testing import (
    assert_all_ranks,
    assert_close_all_ranks,
    assert_raises_all_ranks,
    get_mesh,
    run_on_ranks,
)

SHAPE = (3, 5, 10, 12)  # (trajectory, time, rows, columns)
CHUNKS = (1, 1, 3, 5)  # misaligned with every shard boundary below
INDICES = [(1, 2), (1, 3), (0, 4), (2, 0), (1, 2), (2, 1)]  # 3 runs, one repeat, unsorted
LAYOUTS = ("contiguous", "chunked")


def _values(shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(shape) * 3 + 1).astype(np.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The same field stored contiguously and chunked, written before any rank opens it."""
    paths = {}
    for layout in LAYOUTS:
        path = tmp_path_factory.mktemp("fields") / f"{layout}.h5"
        with h5py.File(path, "w") as file:
            chunks = CHUNKS if layout == "chunked" else None
            file.create_dataset("v", data=_values(), chunks=chunks)
        paths[layout] = str(path)
    return paths


# ---------------------------------------------------------------------------- read recording
class _RecordedFile(io.FileIO):
    """A read-only file that records the ``(offset, length)`` of every read."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "r")
        self.reads: list[tuple[int, int]] = []

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        offset = self.tell()
        count = super().readinto(buffer) or 0
        self.reads.append((offset, count))
        return count

    def read(self, size: int = -1) -> bytes:
        offset = self.tell()
        data = super().read(size)
        self.reads.append((offset, len(data)))
        return data


class RecordingOpener:
    """A file source for the field: opens ``path`` as a :class:`_RecordedFile`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files: list[_RecordedFile] = []

    def __call__(self) -> _RecordedFile:
        self.files.append(_RecordedFile(self.path))
        return self.files[-1]

    def reads(self) -> list[tuple[int, int]]:
        return [read for file in self.files for read in file.reads]

    def close(self) -> None:
        for file in self.files:
            file.close()


def _storage_units(path: str) -> tuple[list[tuple[int, int, tuple[int, ...]]], bool]:
    """Byte offset, byte size and unit of every storage unit of dataset ``v``, and whether it
    is chunked. A unit is an element's index (contiguous) or a chunk's first element."""
    with h5py.File(path, "r") as file:
        dataset = file["v"]
        if dataset.chunks is None:
            base, itemsize = dataset.id.get_offset(), dataset.dtype.itemsize
            elements = np.ndindex(*SHAPE)
            return [(base + k * itemsize, itemsize, e) for k, e in enumerate(elements)], False
        infos = [dataset.id.get_chunk_info(i) for i in range(dataset.id.get_num_chunks())]
        return [(i.byte_offset, i.size, tuple(i.chunk_offset)) for i in infos], True


def _unit_of(index: tuple[int, ...], chunked: bool) -> tuple[int, ...]:
    return tuple(i - i % c for i, c in zip(index, CHUNKS)) if chunked else tuple(index)


def _check_reads_only_own_slab(
    opener: RecordingOpener, samples: np.ndarray, box: tuple[slice, ...]
) -> None:
    """Every data byte read belongs to a unit of this rank's slab; each such unit read once."""
    units, chunked = _storage_units(opener.path)
    read_bytes: dict[tuple[int, ...], int] = {}
    for offset, length in opener.reads():
        for start, size, unit in units:
            overlap = min(offset + length, start + size) - max(offset, start)
            if overlap > 0:
                read_bytes[unit] = read_bytes.get(unit, 0) + overlap
    cells = list(product(*(range(s.start, s.stop) for s in box)))
    expected = {
        _unit_of((*sample, *cell), chunked) for sample in samples.tolist() for cell in cells
    }
    unit_sizes = {unit: size for _, size, unit in units}
    extra = sorted(set(read_bytes) - expected)[:3]
    missing = sorted(expected - set(read_bytes))[:3]
    reread = [(u, n) for u, n in read_bytes.items() if n != unit_sizes[u]][:3]
    assert_all_ranks(
        not extra and not missing and not reread,
        f"slab {box}: read units outside it {extra}, missed {missing}, partly/re-read {reread}",
    )


# ---------------------------------------------------------------------------- reads
Case = tuple[tuple[int, ...], dict[int, int], dict[int, tuple[int, ...]]]
"""Mesh shape, mesh axis -> sharded dataset dim, dataset dim -> shard sizes."""

CASES: dict[str, Case] = {
    "2 ranks, rows 7|3": ((2,), {0: 2}, {2: (7, 3)}),
    "4 ranks, columns 0|5|1|6": ((4,), {0: 3}, {3: (0, 5, 1, 6)}),
    "2x2, rows 10|0 x columns 5|7": ((2, 2), {0: 2, 1: 3}, {2: (10, 0), 3: (5, 7)}),
    "2x2, replicated x columns 6|6": ((2, 2), {1: 3}, {}),
    "2x2, nested rows 1|4|0|5": ((2, 2), {0: 2, 1: 2}, {2: (1, 4, 0, 5)}),
}


def _read_body(path: str, mesh_shape: tuple[int, ...], shard_dims: dict, sizes: dict) -> None:
    mesh = get_mesh(mesh_shape)
    opener = RecordingOpener(path)
    field = ShardedHDF5Field(opener, "v", mesh, shard_dims, index_dims=2, sizes=sizes)
    x = field.read(INDICES)
    rows, times = np.array(INDICES).T
    whole = torch.from_numpy(_values()[rows, times])

    expected_placements = tuple(
        Shard(shard_dims[a] - 1) if a in shard_dims else Replicate() for a in range(mesh.ndim)
    )
    assert_all_ranks(isinstance(x, ShardTensor) and x.shape == whole.shape, f"got {x!r}")
    assert_all_ranks(x.placements == expected_placements, f"placements {x.placements}")
    got_sizes = {s.dim + 1: s.sizes for s in x._spec.shardings}
    assert_all_ranks(all(got_sizes[d] == s for d, s in sizes.items()), f"sizes {got_sizes}")
    assert_close_all_ranks(x.to_local(), x._spec.narrow(whole), atol=0, rtol=0, what="shard")
    assert_close_all_ranks(x.full_tensor(), whole, atol=0, rtol=0, what="gathered")

    samples = np.unique(np.array(INDICES), axis=0)
    _check_reads_only_own_slab(opener, samples, field.local_box())
    field.close()
    opener.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_read_equals_numpy_and_touches_only_own_slab(files, layout: str, case: str) -> None:
    mesh_shape = CASES[case][0]
    run_on_ranks(int(np.prod(mesh_shape)), _read_body, files[layout], *CASES[case])


def test_index_runs_one_hyperslab_per_consecutive_times() -> None:
    indices = np.array([(0, 4), (1, 2), (1, 3), (1, 4), (2, 0), (2, 2), (3, 3)])
    assert index_runs(indices) == [(0, 1), (1, 4), (4, 5), (5, 6), (6, 7)]
    assert index_runs(np.empty((0, 2), dtype=np.int64)) == []


# ---------------------------------------------------------------------------- statistics
def _statistics_body(path: str, mesh_shape: tuple[int, ...], shard_dims: dict, sizes: dict) -> None:
    mesh = get_mesh(mesh_shape)
    opener = RecordingOpener(path)
    field = ShardedHDF5Field(opener, "v", mesh, shard_dims, index_dims=2, sizes=sizes)
    chosen = [(b, t) for b in (0, 2) for t in range(SHAPE[1])]
    # A block of one sample at a time: the rank's own merges are exercised too.
    stats = field.statistics(chosen, max_block_bytes=1)
    reference = _values()[[0, 2]].astype(np.float64)
    expected = [reference.mean(), reference.std(), reference.min(), reference.max()]
    got = torch.stack([stats.mean, stats.std, stats.min, stats.max])
    assert_all_ranks(stats.count == reference.size, f"count {stats.count}")
    assert_close_all_ranks(got, torch.tensor(expected), atol=0, rtol=1e-13, what="statistics")
    everyone = [torch.empty_like(got) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, got)
    assert_all_ranks(all(torch.equal(g, got) for g in everyone), "ranks disagree bitwise")
    _check_reads_only_own_slab(opener, np.array(chosen), field.local_box())
    field.close()
    opener.close()


@pytest.mark.parametrize("case", [c for c in CASES if "nested" not in c])
def test_statistics_equal_numpy_identical_on_every_rank(files, case: str) -> None:
    mesh_shape = CASES[case][0]
    run_on_ranks(int(np.prod(mesh_shape)), _statistics_body, files["chunked"], *CASES[case])


def _channel_statistics_body(path: str) -> None:
    mesh = get_mesh((2, 2))
    field = ShardedHDF5Field(
        path, "c", mesh, {0: 2, 1: 3}, index_dims=1, spatial_dims=(2, 3), sizes={2: (0, 9)}
    )
    stats = field.statistics([3, 0, 1])
    reference = _values((4, 2, 9, 6))[[0, 1, 3]].astype(np.float64)
    for name, expected in [("mean", reference.mean((0, 2, 3))), ("std", reference.std((0, 2, 3)))]:
        got = getattr(stats, name)
        assert_close_all_ranks(got, torch.from_numpy(expected), atol=0, rtol=1e-13, what=name)
    x = field.read([3, 1], dtype=torch.float64)
    assert_all_ranks(x.placements == (Shard(2), Shard(3)) and x.shape == (2, 2, 9, 6))
    whole = torch.from_numpy(_values((4, 2, 9, 6))[[3, 1]]).double()
    assert_close_all_ranks(x.full_tensor(), whole, atol=0, rtol=0, what="channels read")
    field.close()


def test_channels_big_endian_and_dtype(tmp_path) -> None:
    """A channel dim is never sharded and keeps its own statistics; a big-endian file and a
    conversion to float64 read the same values."""
    path = tmp_path / "channels.h5"
    with h5py.File(path, "w") as file:
        file.create_dataset("c", data=_values((4, 2, 9, 6)).astype(">f4"))
    run_on_ranks(4, _channel_statistics_body, str(path))


# ---------------------------------------------------------------------------- batches
def _pairs(**overrides: int) -> NextStepPairs:
    arguments = dict(n_times=5, global_batch=4, seed=7)
    return NextStepPairs(trajectories=(1, 2, 3), **{**arguments, **overrides})


def _as_set(rows: np.ndarray) -> set[tuple[int, int]]:
    return {tuple(row) for row in rows.tolist()}


def test_pairs_split_over_dp_ranks_cover_each_epoch_once() -> None:
    whole = _pairs()
    parts = [_pairs(dp_size=2, dp_rank=r) for r in range(2)]
    assert whole.steps_per_epoch == 3  # 3 trajectories x 4 pairs, 4 per step
    for epoch in range(2):
        seen: list[tuple[int, int]] = []
        for step in range(epoch * 3, epoch * 3 + 3):
            batch = whole.batch(step)
            mine = [p.batch(step) for p in parts]
            assert batch.epoch == epoch
            assert np.array_equal(np.concatenate([m.inputs for m in mine]), batch.inputs)
            assert not _as_set(mine[0].inputs) & _as_set(mine[1].inputs)
            assert np.array_equal(batch.targets, batch.inputs + np.array([0, 1]))
            seen += [tuple(row) for row in batch.inputs.tolist()]
        assert sorted(seen) == [(b, t) for b in range(1, 4) for t in range(4)]
    order = [tuple(map(tuple, whole.batch(s).inputs.tolist())) for s in range(6)]
    assert order[:3] != order[3:], "epochs should be shuffled differently"


def test_pairs_deterministic_per_seed_and_resumable() -> None:
    def run(pairs: NextStepPairs, start: int, stop: int) -> list[np.ndarray]:
        return [b.inputs for b in pairs.batches(start, stop)]

    first = run(_pairs(), 0, 7)
    assert all(np.array_equal(a, b) for a, b in zip(first, run(_pairs(), 0, 7)))
    assert any(not np.array_equal(a, b) for a, b in zip(first, run(_pairs(seed=8), 0, 7)))
    resumed = run(_pairs(), 5, 7)
    assert all(np.array_equal(a, b) for a, b in zip(first[5:], resumed))
    assert [b.step for b in _pairs().batches(5, 7)] == [5, 6]
    two_ahead = _pairs(horizon=2).batch(0)
    assert np.array_equal(two_ahead.targets, two_ahead.inputs + np.array([0, 2]))
    time_first = _pairs(time_dim=0).batch(4)
    assert np.array_equal(time_first.inputs, _pairs().batch(4).inputs[:, ::-1])
    assert np.array_equal(time_first.targets, time_first.inputs + np.array([1, 0]))


def test_pairs_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of the 3 data-parallel ranks"):
        _pairs(dp_size=3)
    with pytest.raises(ValueError, match="horizon < n_times"):
        _pairs(horizon=5)
    with pytest.raises(ValueError, match="exceeds the 12 pairs"):
        _pairs(global_batch=16)
    with pytest.raises(ValueError, match="time_dim must be 0 or 1"):
        _pairs(time_dim=2)
    with pytest.raises(ValueError, match="step must be >= 0"):
        _pairs().batch(-1)


def _dp_domain_body(path: str) -> None:
    mesh = get_mesh((2, 2), ("dp", "domain"))
    field = ShardedHDF5Field(path, "v", mesh["domain"], {"domain": 3}, index_dims=2)
    kwargs = dict(trajectories=range(3), n_times=SHAPE[1], global_batch=4, seed=3)
    pairs = NextStepPairs.on_mesh(mesh, "dp", **kwargs)
    batch = pairs.batch(5)
    x, y = batch.read(field)
    values = torch.from_numpy(_values())
    assert_close_all_ranks(
        x.full_tensor(), values[tuple(batch.inputs.T)], atol=0, rtol=0, what="inputs"
    )
    assert_close_all_ranks(
        y.full_tensor(), values[tuple(batch.targets.T)], atol=0, rtol=0, what="targets"
    )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, batch.inputs.tolist())
    dp, _ = mesh.get_coordinate()
    peers = [everyone[r] for r in mesh["domain"].mesh.tolist()]
    expected = NextStepPairs(**kwargs).batch(5).inputs.tolist()
    assert_all_ranks(all(p == peers[0] for p in peers), f"domain ranks disagree: {peers}")
    assert_all_ranks(everyone[0] + everyone[2] == expected, f"dp parts {everyone} vs {expected}")
    assert_all_ranks(pairs.dp_rank == dp and pairs.dp_size == 2)
    field.close()


def test_pairs_on_a_dp_by_domain_mesh(files) -> None:
    run_on_ranks(4, _dp_domain_body, files["chunked"])


# ---------------------------------------------------------------------------- errors, fork
def _bad_input_body(path: str) -> None:
    mesh = get_mesh((2,), ("x",))

    def field(shard_dims: dict | None = None, sizes: dict | None = None) -> ShardedHDF5Field:
        return ShardedHDF5Field(path, "v", mesh, shard_dims or {"x": 2}, index_dims=2, sizes=sizes)

    assert_raises_all_ranks(ValueError, "no axis named 'y'", field, shard_dims={"y": 2})
    assert_raises_all_ranks(
        ValueError, "not one of the spatial dims", lambda: field(shard_dims={"x": 1}).read([(0, 0)])
    )
    assert_raises_all_ranks(
        ValueError,
        "dims \\[3\\], which no mesh axis",
        lambda: field(sizes={3: (6, 6)}).read([(0, 0)]),
    )
    assert_raises_all_ranks(ValueError, "sum to 9", lambda: field(sizes={2: (4, 5)}).read([(0, 0)]))
    assert_raises_all_ranks(IndexError, "\\(3, 0\\) is out of range", field().read, [(3, 0)])
    assert_raises_all_ranks(ValueError, "shape \\(S, 2\\)", field().read, [1, 2])
    assert_raises_all_ranks(
        KeyError,
        "no dataset 'w'",
        lambda: ShardedHDF5Field(path, "w", mesh, {}, index_dims=2).shape,
    )


def test_bad_input(files) -> None:
    run_on_ranks(2, _bad_input_body, files["contiguous"])


def test_source_never_uses_a_handle_across_fork(files) -> None:
    source = HDF5Source(files["contiguous"], "v")
    assert source.shape == SHAPE  # opens a handle in this process
    clone = pickle.loads(pickle.dumps(source))
    assert clone._file is None and clone.dataset()[2, 4, 9, 11] == _values()[2, 4, 9, 11]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: h5py only, then leave without running any cleanup
        try:
            inherited = source._file
            value = source.dataset()[1, 2, 3, 4]
            ok = source._opened_by == os.getpid() and source._file is not inherited
            ok = ok and value == _values()[1, 2, 3, 4]
            os.write(write_end, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child did not finish")
        time.sleep(0.01)
    assert os.read(read_end, 2) == b"ok"
    os.close(read_end)
    assert source._opened_by == os.getpid()
    source.close()
    clone.close()
