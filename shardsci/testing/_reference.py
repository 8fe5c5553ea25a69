"""Compare a sharded computation with a single-process run on the same global data.

Run inside a rank body (see ``run_on_ranks``). Every rank builds the same global inputs (the
pool seeds each call identically), runs ``fn`` once on plain tensors (the reference) and once
on ShardTensors laid out as asked, and checks, on every rank together:
- each output's shards are the shapes its spec says (the true-size invariant),
- the gathered outputs equal the reference outputs,
- the gradients of a random projection of the outputs equal the reference gradients, for every
  sharded input (its local shard of the reference gradient), every plain input and every
  module parameter (the sum over shards, compared with the single-device gradient).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from shardsci.tensor import ShardTensor, ShardTensorSpec
from shardsci.tensor._api import from_local_spec, grad_spec
from shardsci.testing._collective_asserts import assert_all_ranks, assert_close_all_ranks

__all__ = ["Layout", "check_against_reference"]


@dataclass(frozen=True)
class Layout:
    """How one input of a reference check is sharded.

    Attributes
    ----------
    placements : tuple of Placement
        One per mesh axis.
    sizes : dict, optional
        Tensor dim -> shard sizes, row-major over the axes sharding it (default ``torch.chunk``).
    order : dict, optional
        Tensor dim -> mesh axes sharding it, outermost first (default: increasing axis).
    """

    placements: tuple[Placement, ...]
    sizes: Mapping[int, Sequence[int]] = field(default_factory=dict)
    order: Mapping[int, Sequence[int]] = field(default_factory=dict)

    def spec(self, mesh: DeviceMesh, tensor: torch.Tensor) -> ShardTensorSpec:
        return ShardTensorSpec.build(
            mesh,
            self.placements,
            tensor.shape,
            tensor.dtype,
            dict(self.sizes) or None,
            order=dict(self.order) or None,
        )


def check_against_reference(
    fn: Callable[..., object],
    inputs: Sequence[torch.Tensor],
    layouts: Sequence[Layout | None],
    mesh: DeviceMesh,
    *,
    module: nn.Module | None = None,
    atol: float = 1e-10,
    rtol: float = 1e-10,
    grad: bool = True,
    what: str = "",
) -> list[object]:
    """Check ``fn`` on sharded inputs against ``fn`` on the whole inputs.

    Parameters
    ----------
    fn : callable
        ``fn(*inputs)`` or, with ``module``, ``fn(module, *inputs)``; returns a tensor or a
        sequence of tensors.
    inputs : sequence of Tensor
        Global inputs, identical on every rank.
    layouts : sequence of Layout or None
        One per input; None passes the input as a plain tensor (held whole by every rank).
    module : nn.Module, optional
        Run as given on the ShardTensors and as a deep copy for the reference; its parameter
        gradients are compared too.
    grad : bool
        Also compare gradients (floating-point inputs and outputs only).

    Returns
    -------
    list
        The sharded outputs, for further checks by the caller.
    """
    label = f"{what}: " if what else ""
    reference_inputs = [_leaf(x, grad) for x in inputs]
    reference_module = copy.deepcopy(module) if module is not None else None
    reference_out = _outputs(_call(fn, reference_module, reference_inputs))
    projections = [_projection(o) for o in reference_out]
    if grad:
        _backward(reference_out, projections)

    sharded_leaves: list[torch.Tensor] = []
    specs: list[ShardTensorSpec | None] = []
    sharded_inputs: list[torch.Tensor] = []
    for x, layout in zip(inputs, layouts):
        if layout is None:
            leaf = _leaf(x, grad)
            sharded_leaves.append(leaf)
            specs.append(None)
            sharded_inputs.append(leaf)
        else:
            spec = layout.spec(mesh, x)
            leaf = _leaf(spec.narrow(x), grad)
            sharded_leaves.append(leaf)
            specs.append(spec)
            sharded_inputs.append(from_local_spec(leaf, spec))
    sharded_out = _outputs(_call(fn, module, sharded_inputs))

    assert_all_ranks(
        len(sharded_out) == len(reference_out),
        f"{label}{len(sharded_out)} outputs, reference has {len(reference_out)}",
    )
    for i, (out, expected) in enumerate(zip(sharded_out, reference_out)):
        _check_output(out, expected, atol, rtol, f"{label}output {i}")
    if grad:
        _backward(sharded_out, [_like(p, o) for p, o in zip(projections, sharded_out)])
        for i, (leaf, spec, ref) in enumerate(zip(sharded_leaves, specs, reference_inputs)):
            if ref.grad is not None or leaf.grad is not None:
                expected = ref.grad if spec is None or ref.grad is None else spec.narrow(ref.grad)
                _check_grad(leaf.grad, expected, atol, rtol, f"{label}grad of input {i}")
        if module is not None:
            for (name, p), ref_p in zip(module.named_parameters(), reference_module.parameters()):
                _check_grad(p.grad, ref_p.grad, atol, rtol, f"{label}grad of parameter {name}")
    return sharded_out


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    leaf = x.detach().clone()
    if grad and (leaf.is_floating_point() or leaf.is_complex()):
        leaf.requires_grad_(True)
    return leaf


def _call(fn: Callable[..., object], module: nn.Module | None, inputs: list) -> object:
    return fn(module, *inputs) if module is not None else fn(*inputs)


def _outputs(result: object) -> list:
    if isinstance(result, (tuple, list)):
        return list(result)
    return [result]


def _projection(out: object) -> torch.Tensor | None:
    """A fixed random weight per differentiable output: the loss is ``sum(out * weight)``."""
    if isinstance(out, torch.Tensor) and out.requires_grad:
        return torch.randn(out.shape, dtype=out.dtype, device=out.device)
    return None


def _like(projection: torch.Tensor | None, out: object) -> torch.Tensor | None:
    """The projection laid out like the sharded output (Partial axes read as Replicate)."""
    if projection is None or not isinstance(out, ShardTensor):
        return projection
    spec = grad_spec(out._spec).with_dtype(projection.dtype)
    return from_local_spec(spec.narrow(projection), spec)


def _backward(outputs: list, projections: list) -> None:
    terms = [
        (o * p).sum() for o, p in zip(outputs, projections) if p is not None and o.requires_grad
    ]
    if not terms:
        return
    loss = sum(terms[1:], terms[0])
    if isinstance(loss, ShardTensor):
        loss = loss.full_tensor()
    loss.backward()


def _check_output(out: object, expected: object, atol: float, rtol: float, what: str) -> None:
    if not isinstance(expected, torch.Tensor):
        assert_all_ranks(out == expected, f"{what}: got {out!r}, expected {expected!r}")
        return
    if isinstance(out, ShardTensor):
        local_shape = tuple(out._local.shape)
        spec_shape = tuple(out._spec.local_shape())
        assert_all_ranks(
            local_shape == spec_shape,
            f"{what}: shard has shape {local_shape} but its spec says {spec_shape} ({out._spec})",
        )
        with torch.no_grad():
            out = out.full_tensor()
    assert_close_all_ranks(out.detach(), expected.detach(), atol=atol, rtol=rtol, what=what)


def _check_grad(
    actual: torch.Tensor | None, expected: torch.Tensor | None, atol: float, rtol: float, what: str
) -> None:
    assert_all_ranks(
        (actual is None) == (expected is None),
        f"{what}: one of sharded ({actual is not None}) and reference "
        f"({expected is not None}) gradients is missing",
    )
    if actual is not None:
        if isinstance(actual, ShardTensor):
            actual = actual.full_tensor()
        assert_close_all_ranks(actual, expected, atol=atol, rtol=rtol, what=what)
