"""Live tensor memory of this rank during a step, by category, and its peak.

# NOTE [What the memory figures count]
Memory is the bytes of the storages of live tensors on the tracked device, what
``torch.cuda.memory_allocated`` reports on a GPU without its rounding to 512-byte blocks:
every storage an aten op creates on that device while a ``LiveMemory`` is active counts from
its creation until it is freed, plus the storages registered as already live (parameters,
gradients, optimiser state, the batch, the gradient reducer's buckets). ShardTensors are wrappers and own nothing: the
tracker lets them dispatch and counts the storages of the local tensors their ops create.
Tensors made to compute shapes hold no memory and are skipped: those of sharding propagation
(made under a FakeTensorMode) and shape probes (NOTE [Shape probes hold no memory]); a dry
run tracks the ``meta`` device, where its simulated shards live. Not counted: workspace that
kernels allocate
internally (cuDNN, oneDNN, im2col buffers), communication-library buffers, allocator caching
and fragmentation; a device budget needs headroom for those. The same tracker measures real
runs (on real data and real collectives) and dry runs (on ``meta`` tensors), so a mismatch
between the two is a mismatch between what the library does in each.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterable

import torch

from shardsci.tensor import ShardTensor
from shardsci.tensor._shape_probe import probing
from shardsci.tensor._torch_compat import TorchDispatchMode, active_fake_mode, tree_leaves

__all__ = ["Category", "LiveMemory"]


class Category(enum.Enum):
    """What a storage holds."""

    parameters = "parameters"
    gradients = "gradients"
    optimizer = "optimizer"
    batch = "batch"
    grad_buckets = "grad_buckets"
    """The gradient reducer's flat buffers: one more copy of the gradients, held for the
    whole run (NOTE [A reducer's gradients are final or absent])."""
    activations = "activations"
    """Everything the step creates that is none of the above: activations saved for the
    backward pass, temporaries, halo buffers, messages."""


class _Storage(weakref.ref):
    """A weak reference to a counted storage, with its size and category."""

    __slots__ = ("category", "key", "nbytes")


class LiveMemory(TorchDispatchMode):
    """Bytes of live tensor storage by category and the peak of their total (see NOTE
    [What the memory figures count]).

    Parameters
    ----------
    device_type : str
        The device whose tensors count: ``"cpu"``, ``"cuda"``, or ``"meta"`` in a dry run.
    where : callable, optional
        Returns a description of what runs now; kept for the moment of the peak.

    Attributes
    ----------
    live : dict
        Category -> bytes live now.
    peak : int
        Largest total seen.
    peak_live : dict
        Category -> bytes at the moment of the peak.
    peak_where : object
        ``where()`` at the moment of the peak.
    peak_activations : int
        Largest ``live[Category.activations]`` seen.
    """

    def __init__(self, device_type: str, where: Callable[[], object] | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.where = where or (lambda: None)
        self.live = dict.fromkeys(Category, 0)
        self.peak = 0
        self.peak_live = dict(self.live)
        self.peak_where: object = None
        self.peak_activations = 0
        self.category = Category.activations
        self.total = 0
        self._storages: dict[int, _Storage] = {}

    def add(self, tensors: Iterable[torch.Tensor | None], category: Category) -> None:
        """Count tensors that exist already (or move them to ``category``)."""
        for tensor in tensors:
            if tensor is not None:
                self._track(tensor, category, relabel=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if any(issubclass(t, ShardTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if probing() or active_fake_mode() is not None:
            return out
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, self.category, relabel=False)
        return out

    def _track(self, tensor: torch.Tensor, category: Category, relabel: bool) -> None:
        if isinstance(tensor, ShardTensor):
            tensor = tensor._local
        if tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        known = self._storages.get(id(storage))
        if known is not None:
            if relabel and known.category is not category:
                self.live[known.category] -= known.nbytes
                self.live[category] += known.nbytes
                known.category = category
            return
        record = _Storage(storage, self._freed)
        record.key, record.nbytes, record.category = id(storage), storage.nbytes(), category
        self._storages[record.key] = record
        self.live[category] += record.nbytes
        self.total += record.nbytes
        if category is Category.activations:
            self.peak_activations = max(self.peak_activations, self.live[category])
        if self.total > self.peak:
            self.peak = self.total
            self.peak_live = dict(self.live)
            self.peak_where = self.where()

    def _freed(self, record: _Storage) -> None:
        del self._storages[record.key]
        self.live[record.category] -= record.nbytes
        self.total -= record.nbytes
