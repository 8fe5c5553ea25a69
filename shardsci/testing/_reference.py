"""Compare a sharded computation with a single-process run on the same global data.

Run inside a rank body (see ``run_on_ranks``). Every rank builds the same global inputs (the
pool seeds each call identically), runs ``fn`` once on plain tensors (the reference) and once
on ShardTensors laid out as asked, and checks, on every rank together:
- each output is a ShardTensor laid out as stated (NOTE [An output's layout is stated]),
- each output's shards are the shapes its spec says (the true-size invariant),
- the sharded forward gathered no input: no rank received as many bytes as it lacks of the
  largest sharded input (the traffic of gathering it whole),
- shardsci's byte count (``comm_counter``) agrees with an independent count of the collectives
  issued (``count_traffic``), forward and backward: no traffic goes around it,
- the gathered outputs equal the reference outputs,
- the gradients of a random projection of the outputs equal the reference gradients, for every
  sharded input (its local shard of the reference gradient), every plain input and every
  module parameter (the sum over shards, compared with the single-device gradient),
- the module's buffers (batch-norm running statistics and counters) equal the reference
  module's after the run.

Every problem found is reported, not only the first: a wrong layout does not hide wrong values.
They are raised together, on every rank alike, as one ``ReferenceMismatch`` whose ``problems``
name the aspect each concerns (``traffic``, ``layout``, ``values``, ``gradients``,
``buffers``), so a test can tell a kept layout with wrong values from the reverse.

# NOTE [An output's layout is stated]
Right values in the wrong layout are a bug a value check cannot see: an op that gathers its
input, computes on the whole tensor and splits the result again (with ``torch.chunk`` sizes,
or not at all) returns the right numbers. So every output of a sharded computation must be a
ShardTensor on the same mesh with the placements and shard sizes the caller states
(``out_layouts``), and where the caller states nothing, an output of the first sharded
input's shape must keep that input's layout; any other output has no default and fails until
its layout is stated.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from shardsci.tensor import ShardTensor, ShardTensorSpec, comm_counter
from shardsci.tensor._api import from_local_spec, grad_spec
from shardsci.testing._collective_asserts import assert_all_ranks, assert_close_all_ranks
from shardsci.testing._traffic import Traffic, count_traffic, traffic_problems

__all__ = ["ASPECTS", "ExpectedLayout", "Layout", "ReferenceMismatch", "check_against_reference"]

#: What a problem found by ``check_against_reference`` concerns.
ASPECTS = ("outputs", "traffic", "layout", "values", "gradients", "buffers")


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
        """The spec of ``tensor`` (global shape and dtype) laid out this way on ``mesh``."""
        return ShardTensorSpec.build(
            mesh,
            self.placements,
            tensor.shape,
            tensor.dtype,
            dict(self.sizes) or None,
            order=dict(self.order) or None,
        )


ExpectedLayout = Layout | Callable[[tuple[int, ...]], Layout | None] | None
"""What an output's layout is stated as: a Layout, a function of its global shape, or None."""


class ReferenceMismatch(AssertionError):
    """Every problem ``check_against_reference`` found, the same on every rank.

    Attributes
    ----------
    problems : tuple of (str, str)
        ``(aspect, message)`` per problem, aspect one of ``ASPECTS``.
    """

    def __init__(self, problems: Sequence[tuple[str, str]]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(message for _, message in self.problems))

    @property
    def aspects(self) -> frozenset[str]:
        """The aspects with at least one problem."""
        return frozenset(aspect for aspect, _ in self.problems)


class _Findings:
    """Collects the agreed failures of collective assertions instead of stopping at the first.

    Each assertion is a collective that raises on every rank or on none, so every rank records
    the same problems and goes on through the same collectives.
    """

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def check(self, aspect: str, assertion: Callable[..., object], *args: object) -> None:
        """Run the collective ``assertion(*args)``; record its failure under ``aspect``."""
        try:
            assertion(*args)
        except AssertionError as exc:
            self.problems.append((aspect, str(exc)))

    def raise_any(self) -> None:
        if self.problems:
            raise ReferenceMismatch(self.problems)


def check_against_reference(
    fn: Callable[..., object],
    inputs: Sequence[torch.Tensor],
    layouts: Sequence[Layout | None],
    mesh: DeviceMesh,
    *,
    module: nn.Module | None = None,
    out_layouts: Sequence[ExpectedLayout] | None = None,
    atol: float = 1e-10,
    rtol: float = 1e-10,
    grad: bool = True,
    not_a_gather: str = "",
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
    out_layouts : sequence, optional
        The layout each output must have (NOTE [An output's layout is stated]), one per
        output: a Layout, a function of the output's global shape returning one (or None), or
        None (as when no sequence is given) for the default: the first sharded input's layout,
        for an output of its shape.
    grad : bool
        Also compare gradients (floating-point inputs and outputs only).
    not_a_gather : str
        Why this op legitimately receives as many bytes as a gather of its input would (a
        tiny input whose statistics weigh as much as its shards); skips that check.

    Returns
    -------
    list
        The sharded outputs, for further checks by the caller.
    """
    label = f"{what}: " if what else ""
    findings = _Findings()
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
    with count_traffic() as traffic, comm_counter() as stats:
        sharded_out = _outputs(_call(fn, module, sharded_inputs))
    problems = traffic_problems(stats, traffic)
    if not not_a_gather:
        problems += _gather_problems(traffic, inputs, specs, mesh)
    findings.check(
        "traffic", assert_all_ranks, not problems, f"{label}forward: {'; '.join(problems)}"
    )

    count = f"{label}{len(sharded_out)} outputs, reference has {len(reference_out)}"
    findings.check("outputs", assert_all_ranks, len(sharded_out) == len(reference_out), count)
    expected_layouts = list(out_layouts or [None] * len(sharded_out))
    stated = f"{label}{len(expected_layouts)} out_layouts for {len(sharded_out)} outputs"
    findings.check("outputs", assert_all_ranks, len(expected_layouts) == len(sharded_out), stated)
    findings.raise_any()  # nothing below can be compared output by output
    for i, (out, expected) in enumerate(zip(sharded_out, reference_out)):
        what_out = f"{label}output {i}"
        problem = _layout_problem(out, expected_layouts[i], inputs, layouts, mesh)
        findings.check("layout", assert_all_ranks, not problem, f"{what_out}: {problem}")
        findings.check("values", _check_output, out, expected, atol, rtol, what_out)
    if grad:
        with count_traffic() as traffic, comm_counter() as stats:
            _backward(sharded_out, [_like(p, o) for p, o in zip(projections, sharded_out)])
        problems = traffic_problems(stats, traffic)
        backward = f"{label}backward: {'; '.join(problems)}"
        findings.check("traffic", assert_all_ranks, not problems, backward)
        for i, (leaf, spec, ref) in enumerate(zip(sharded_leaves, specs, reference_inputs)):
            if ref.grad is not None or leaf.grad is not None:
                expected = ref.grad if spec is None or ref.grad is None else spec.narrow(ref.grad)
                what_grad = f"{label}grad of input {i}"
                findings.check(
                    "gradients", _check_close, leaf.grad, expected, atol, rtol, what_grad
                )
        if module is not None:
            for (name, p), ref_p in zip(module.named_parameters(), reference_module.parameters()):
                what_grad = f"{label}grad of parameter {name}"
                findings.check("gradients", _check_close, p.grad, ref_p.grad, atol, rtol, what_grad)
    if module is not None:
        for (name, b), ref_b in zip(module.named_buffers(), reference_module.buffers()):
            findings.check("buffers", _check_close, b, ref_b, atol, rtol, f"{label}buffer {name}")
    findings.raise_any()
    return sharded_out


def _layout_problem(
    out: object,
    stated: ExpectedLayout,
    inputs: Sequence[torch.Tensor],
    layouts: Sequence[Layout | None],
    mesh: DeviceMesh,
) -> str:
    """What is wrong with ``out``'s layout (NOTE [An output's layout is stated]); "" if nothing."""
    sharded = [(x, layout) for x, layout in zip(inputs, layouts) if layout is not None]
    if not isinstance(out, torch.Tensor) or not sharded:
        return ""
    if stated is not None and not isinstance(stated, Layout):
        stated = stated(tuple(out.shape))
    if stated is None:
        first, layout = sharded[0]
        if tuple(out.shape) != tuple(first.shape):
            return (
                f"shape {tuple(out.shape)} differs from the sharded input's "
                f"{tuple(first.shape)}: state its layout (out_layouts=...)"
            )
        stated = layout
    try:
        expected = stated.spec(mesh, out)
    except ValueError as exc:
        return f"the stated layout {stated} does not fit shape {tuple(out.shape)}: {exc}"
    if not isinstance(out, ShardTensor):
        return f"a plain {type(out).__name__}, expected a ShardTensor laid out as {expected}"
    if out._spec.mesh != mesh:
        return f"on mesh {out._spec.mesh}, expected the inputs' mesh {mesh}"
    if out._spec.placements != expected.placements or out._spec.shardings != expected.shardings:
        return f"laid out as {out._spec}, expected {expected}"
    return ""


def _gather_problems(
    traffic: Traffic,
    inputs: Sequence[torch.Tensor],
    specs: Sequence[ShardTensorSpec | None],
    mesh: DeviceMesh,
) -> list[str]:
    """Whether the forward looks like a gather of the largest sharded input: on three ranks or
    more, every rank that lacks part of it received at least that many bytes. (On two ranks a
    legitimate exchange, such as flipping an evenly split dim, moves the same bytes.)

    A collective over the default process group.
    """
    lacking = max(
        (
            (x.numel() - spec.local_shape().numel()) * x.element_size()
            for x, spec in zip(inputs, specs)
            if spec is not None
        ),
        default=0,
    )
    # [ranks that lack something, ranks that lack something and received less]
    counts = torch.tensor([int(lacking > 0), int(lacking > 0 and traffic.received < lacking)])
    dist.all_reduce(counts)
    lack, received_less = counts.tolist()
    if mesh.size() < 3 or lack == 0 or received_less > 0:
        return []
    return [
        f"every rank lacking part of the largest sharded input received at least that "
        f"many bytes (here {traffic.received} for {lacking} lacking): an op on shards must "
        f"not gather its input"
    ]


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


def _check_close(
    actual: torch.Tensor | None, expected: torch.Tensor | None, atol: float, rtol: float, what: str
) -> None:
    """A gradient or buffer of the sharded run (whole, or a ShardTensor) against the
    reference's; both missing is fine."""
    assert_all_ranks(
        (actual is None) == (expected is None),
        f"{what}: one of sharded ({actual is not None}) and reference "
        f"({expected is not None}) is missing",
    )
    if actual is not None:
        with torch.no_grad():
            if isinstance(actual, ShardTensor):
                actual = actual.full_tensor()
            assert_close_all_ranks(
                actual.detach(), expected.detach(), atol=atol, rtol=rtol, what=what
            )
