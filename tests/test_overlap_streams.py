"""The overlap's streams and events (NOTE [Halo overlap on streams]), checked on the CPU.

The CPU has no streams, so the overlap runs as it always did there (no stream object is
created). The stream path is driven here by ``RecordingStreams``, a stand-in for
``shardsci.tensor._streams.DeviceStreams`` put in its seam, which runs nothing on any stream:
it tracks which stream is current and orders streams by vector clocks through the events
recorded and waited on. ``StreamChecker`` (a dispatch mode) sees every aten op and judges the
order from the ops alone, as a GPU would execute them: an op reading or writing a storage
after another stream wrote or read it must be ordered after that access by events, and a
storage freed while a stream other than the one it was allocated on may still use it must
have been ``record_stream``'d to that stream. Messages run on a stream of their own, ordered
after the stream posting them, and ``wait()`` orders the stream current at the wait after them
(how ProcessGroupNCCL's ``Work.wait`` behaves). What only a GPU can show is in
tests/test_gpu.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

import shardsci
from shardsci.tensor import _halo, _streams
from shardsci.testing import get_mesh, run_on_ranks

SABOTAGES = ("producer-wait", "consumer-wait", "keep")


class _Stream:
    def __init__(self, name: str, clock: dict[str, int] | None = None) -> None:
        self.name = name
        self.clock = dict(clock or {})
        self.clock[name] = self.clock.get(name, 0)

    def tick(self) -> int:
        self.clock[self.name] += 1
        return self.clock[self.name]

    def join(self, clock: dict[str, int]) -> None:
        for name, tick in clock.items():
            self.clock[name] = max(self.clock.get(name, 0), tick)

    def after(self, name: str, tick: int) -> bool:
        return self.clock.get(name, 0) >= tick


class RecordingStreams:
    """A stand-in for ``DeviceStreams`` on the CPU; ``skip`` names an event wait it ignores
    (a sabotage)."""

    def __init__(self, skip: str | None = None) -> None:
        self.skip = skip
        self.consumer = _Stream("consumer")
        self.side = _Stream("side")
        self.current = [self.consumer]
        self.recorded: dict[int, set[str]] = {}
        self.calls: list[str] = []

    def side_stream(self, device):
        return self.side

    def current_stream(self, device):
        return self.current[-1]

    @contextmanager
    def using(self, stream):
        self.current.append(stream)
        try:
            yield
        finally:
            self.current.pop()

    def record_event(self, stream):
        self.calls.append(f"record {stream.name}")
        return dict(stream.clock)

    def wait_event(self, stream, event):
        self.calls.append(f"wait {stream.name}")
        role = "producer-wait" if stream is self.side else "consumer-wait"
        if self.skip != role:
            stream.join(event)

    def record_stream(self, tensor, stream):
        self.calls.append(f"record_stream {stream.name}")
        key = tensor.untyped_storage().data_ptr()
        self.recorded.setdefault(key, set()).add(stream.name)


class _Storage:
    def __init__(self, storage, allocated: str) -> None:
        self.ref = StorageWeakRef(storage)
        self.allocated = allocated
        self.write: tuple[str, int] = ("", 0)
        self.reads: list[tuple[str, int]] = []
        self.used: dict[str, int] = {}


class StreamChecker(TorchDispatchMode):
    """Every aten op, ordered as the streams would run it; ``problems`` lists the races."""

    def __init__(self, streams: RecordingStreams) -> None:
        super().__init__()
        self.streams = streams
        self.storages: dict[int, _Storage] = {}
        self.problems: list[str] = []
        self.messages = 0

    def _entry(self, t: torch.Tensor, stream: _Stream) -> _Storage | None:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return None
        key = storage.data_ptr()
        entry = self.storages.get(key)
        if entry is None or entry.ref.expired():
            entry = self.storages[key] = _Storage(storage, stream.name)
        return entry

    def access(self, t: torch.Tensor, stream: _Stream, write: bool, what: str) -> None:
        entry = self._entry(t, stream)
        if entry is None:
            return
        tick = stream.tick()
        earlier = [entry.write] + (entry.reads if write else [])
        for name, at in earlier:
            if name and name != stream.name and not stream.after(name, at):
                self.problems.append(f"{what} on {stream.name} races {name}'s access")
        if write:
            entry.write, entry.reads = (stream.name, tick), []
        else:
            entry.reads.append((stream.name, tick))
        entry.used[stream.name] = tick

    def collect(self) -> None:
        """Storages freed since the last op: every stream that used one is ordered before its
        allocating stream reuses it, or recorded."""
        for key, entry in list(self.storages.items()):
            if not entry.ref.expired():
                continue
            del self.storages[key]
            owner = {"consumer": self.streams.consumer, "side": self.streams.side}.get(
                entry.allocated
            )
            recorded = self.streams.recorded.pop(key, set())
            for name, tick in entry.used.items():
                unordered = owner is not None and not owner.after(name, tick)
                if unordered and name != entry.allocated and name not in recorded:
                    self.problems.append(
                        f"a storage of {entry.allocated} freed while {name} may use it"
                    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        self.collect()
        out = func(*args, **kwargs)
        schema = func._schema
        if func.namespace == "c10d" or any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        ):
            return out  # messages are ordered in _messages; views touch no data
        stream = self.streams.current[-1]
        values = dict(zip((a.name for a in schema.arguments), args)) | kwargs
        for argument in schema.arguments:
            value = values.get(argument.name)
            written = argument.alias_info is not None and argument.alias_info.is_write
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor):
                    self.access(t, stream, written, str(func))
        results = out if isinstance(out, (list, tuple)) else [out]
        for t in results:
            if isinstance(t, torch.Tensor):
                self.access(t, stream, True, str(func))
        return out


@contextmanager
def _messages(checker: StreamChecker):
    """``start_send_recv`` as NCCL orders it: the messages on a stream of their own, after
    the posting stream, holding their tensors; ``wait`` orders the current stream after
    them."""
    original = _halo.start_send_recv

    def post(group, sends, receives, **kwargs):
        pending = original(group, sends, receives, **kwargs)
        checker.messages += 1
        comm = _Stream(f"messages{checker.messages}", checker.streams.current[-1].clock)
        for t, write in [(t, False) for _, t in sends] + [(t, True) for t in pending.buffers]:
            checker.access(t, comm, write, "receive" if write else "send")
            # ProcessGroupNCCL keeps its tensors until the messages are done (record_stream,
            # or stashed until ``wait``)
            key = t.untyped_storage().data_ptr()
            checker.streams.recorded.setdefault(key, set()).add(comm.name)
        wait = pending.wait

        def ordered_wait():
            checker.streams.current[-1].join(comm.clock)
            return wait()

        pending.wait = ordered_wait
        return pending

    _halo.start_send_recv = post
    try:
        yield
    finally:
        _halo.start_send_recv = original


class _KeepingNothing(_halo._SideExchange):
    """A sabotage: what the side stream reads is not held until the consumer waited for it."""

    def __init__(self, pending, side, device, keep) -> None:
        super().__init__(pending, side, device, [])


def _overlap_on_recorded_streams(mode: str, skip: str | None, streams_on: bool):
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode, dtype=torch.float64)
    x = torch.randn(2, 2, 14, 6, dtype=torch.float64)
    xs = shardsci.distribute_tensor(x, get_mesh((2,)), [Shard(2)], {0: (9, 5)})
    xs.requires_grad_()
    streams = RecordingStreams(skip)
    checker = StreamChecker(streams)
    previous, exchange = _streams._ACTIVE[0], _halo._SideExchange
    if streams_on:
        _streams._ACTIVE[0] = streams
    if skip == "keep":
        _halo._SideExchange = _KeepingNothing
    try:
        with shardsci.overlap_halos(), checker, _messages(checker):
            out = conv(xs * 1.5)  # the shard's producer runs on the consumer stream
            out.to_local().square().sum().backward()
        checker.collect()
    finally:
        _streams._ACTIVE[0], _halo._SideExchange = previous, exchange
    return {
        "problems": sorted(set(checker.problems)),
        "calls": streams.calls,
        "out": out.full_tensor(),
        "grad": xs.grad.full_tensor(),
    }


@pytest.mark.parametrize("mode", ["zeros", "circular"])
def test_overlap_on_streams_is_ordered_and_equals_the_cpu_path(mode) -> None:
    streamed = run_on_ranks(2, _overlap_on_recorded_streams, mode, None, True)
    plain = run_on_ranks(2, _overlap_on_recorded_streams, mode, None, False)
    for rank, (s, p) in enumerate(zip(streamed, plain)):
        assert s["problems"] == [], (rank, s["problems"])
        assert "wait side" in s["calls"] and "wait consumer" in s["calls"], s["calls"]
        assert p["calls"] == [] and p["problems"] == []
        torch.testing.assert_close(s["out"], p["out"], rtol=0, atol=0)
        torch.testing.assert_close(s["grad"], p["grad"], rtol=0, atol=0)


@pytest.mark.parametrize("skip", SABOTAGES)
def test_the_stream_check_fails_when_an_order_is_dropped(skip) -> None:
    """Negative controls: the side stream packing before the shard's producer finished, the
    consumer unpacking before the messages arrived, the gradient buffer the side stream packs
    from freed before the consumer waited for the side stream."""
    for result in run_on_ranks(2, _overlap_on_recorded_streams, "zeros", skip, True):
        assert result["problems"], skip


def test_no_stream_is_created_on_a_device_without_streams() -> None:
    ops = _streams.DeviceStreams()
    before = shardsci.tensor.cache_sizes()["halo side streams"]
    for device in ("cpu", "meta"):
        assert ops.side_stream(torch.device(device)) is None
    assert shardsci.tensor.cache_sizes()["halo side streams"] == before == 0
