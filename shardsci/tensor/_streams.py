"""The stream and event operations of halo exchanges overlapped on an accelerator
(NOTE [Halo overlap on streams] in ``_halo.py``), behind one seam.

Everything here is device-agnostic (``torch.Stream``, ``torch.Event``, ``torch.accelerator``,
present from torch 2.6 on); a device that is not the accelerator (the CPU, meta) has no side
stream, and the overlap then runs as it always did, creating no stream object.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from shardsci.tensor._caches import BoundedCache

__all__ = ["DeviceStreams", "stream_ops"]

_SIDE: BoundedCache[torch.device, torch.Stream] = BoundedCache("halo side streams", 64)


class DeviceStreams:
    """Streams and events of the current accelerator (the one implementation outside tests).

    Methods
    -------
    side_stream(device)
        The stream halo exchanges on ``device`` run on (one per device, created once), or None
        when ``device`` has no streams.
    current_stream(device), using(stream)
        The stream work is queued on now; a block during which it is ``stream``.
    record_event(stream), wait_event(stream, event)
        An event marking the work queued on ``stream`` so far; make ``stream`` wait for one.
    record_stream(tensor, stream)
        Tell the caching allocator that ``stream`` uses ``tensor`` (allocated on another).
    """

    def side_stream(self, device: torch.device) -> torch.Stream | None:
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or device.type != accelerator.type:
            return None
        return _SIDE.get_or_make(device, lambda: torch.Stream(device=device))

    def current_stream(self, device: torch.device) -> torch.Stream:
        return torch.accelerator.current_stream(device)

    @contextmanager
    def using(self, stream: torch.Stream) -> Iterator[None]:
        with stream:
            yield

    def record_event(self, stream: torch.Stream) -> torch.Event:
        return stream.record_event()

    def wait_event(self, stream: torch.Stream, event: torch.Event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.Stream) -> None:
        tensor.record_stream(stream)


# The seam: tests put a recording stand-in with the same methods here
# (tests/test_overlap_streams.py).
_ACTIVE = [DeviceStreams()]


def stream_ops() -> DeviceStreams:
    return _ACTIVE[0]
