"""PyTorch's OpInfo database on ShardTensors: every sample, sharded, against one process.

Each case is one OpInfo sample (float64, CPU) run twice on every rank: on plain tensors (the
reference) and with its first tensor argument sharded as a layout says (``SWEEP_LAYOUTS`` in
``tests/op_db_layouts.py``), the other tensor arguments passed as plain tensors. A case is

- ``ok``: every output has the reference's values, dtype and shape, each shard the size its
  spec says, and the layout its cells' dependencies state (NOTE [An output cell belongs to the
  shard it depends on] in ``tests/expected_layouts.py``); and the gradient of every
  differentiable tensor argument (the sharded one and the plain ones) matches;
- ``not-checked``: as ``ok`` as far as it was checked, but something was not: the values of a
  random or uninitialised output (``op_db_unsupported.VALUES_NOT_COMPARED``), or the gradients
  when the reference's own backward raised;
- ``error``: every rank raised the same type of error, with a message that names the op;
- ``gathered``: right but for an output replicated on a mesh axis where it should be split
  (``op_db_unsupported.GATHERED_LAYOUT``), and not silently: the gather guard recorded a
  gather, and the case run again under ``gather_policy("error")`` raised ``GatherError`` on
  every rank (NOTE [Gathers an op was not asked to make] in
  ``shardsci/tensor/_gather_guard.py``);
- ``wrong``: it ran everywhere and some output, layout or gradient differs (silently wrong),
  a gathered output among them that the guard did not see or did not refuse;
- ``unclear``: every rank raised, but the message does not say which op failed;
- ``some-ranks``: only some ranks raised, they raised different errors, or a rank died or
  hung (found by a deadline on a separate process group, see NOTE [Agreeing on a case's
  outcome] in ``tests/agreement.py``);
- ``skipped``: not applicable to the layout (no dim large enough to shard) or the reference
  itself raised.

Errors are accepted only where ``op_db_unsupported.py`` lists them, by op, sample and message;
``tests/test_op_db.py`` holds the sweep to that list. ``python -m tests.op_db_sweep`` runs the
whole database and prints the counts per layout (see ``--help``); the summary the README cites,
``docs/op_db_sweep.json`` and ``.md``, is written by::

    OMP_NUM_THREADS=1 python -m tests.op_db_sweep --samples 3 --summary docs/op_db_sweep
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

from shardsci.testing import Layout, RankFailure, get_mesh, run_on_ranks
from tests.agreement import agree
from tests.boxes import dim_shardings
from tests.expected_layouts import (
    AxisRule,
    Dependence,
    axis_rules,
    cell_owners,
    documented,
    held_where,
)
from tests.op_db_layouts import SWEEP_LAYOUTS, SweepLayout

LAYOUTS = SWEEP_LAYOUTS
OUTCOMES = ("ok", "not-checked", "error", "gathered", "wrong", "some-ranks", "unclear", "skipped")
_ATOL = 1e-7
_RTOL = 1e-7


# ---------------------------------------------------------------------------- the database
def op_key(op) -> str:
    """An OpInfo's name in reports and in the unsupported list: ``name`` or
    ``name.variant``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@functools.cache
def database() -> dict[str, object]:
    """OpInfo key -> OpInfo, for the ops that support float64 on CPU (imported on first use:
    the database costs seconds to import)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return {op_key(op): op for op in op_db if torch.float64 in op.supported_dtypes("cpu")}


class _SampleStream:
    """The samples of one op, generated on demand, each the same on every rank and in every
    run (sample ``i`` depends only on the op's key and ``i``).

    As ``OpInfo.sample_inputs`` does, the random generators are reseeded before each sample;
    unlike it, the generator function is called directly: ``sample_inputs`` looks for the
    calling unittest with ``inspect.stack()``, which reads the source of every frame (a
    quarter of a second an op, deep in a rank pool)."""

    def __init__(self, key: str) -> None:
        op = database()[key]
        self.key = key
        self._samples: list = []
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.default_generator.manual_seed(sum(key.encode()))
            generated = op.sample_inputs_func(op, "cpu", torch.float64, op.supports_autograd)
            self._iterator = iter(generated)

    def first(self, n: int | None) -> list:
        """The first ``n`` samples (all with None), fewer if the op has fewer."""
        while n is None or len(self._samples) < n:
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _reseed(_SAMPLE_SEED)
                sample = next(self._iterator, None)
            if sample is None:
                break
            self._samples.append(sample)
        return self._samples[:n]


_SAMPLE_SEED = 1234  # torch.testing._internal.common_utils.SEED


def _reseed(seed: int) -> None:
    """``common_utils.set_rng_seed`` for the CPU: torch's generator, ``random``, numpy."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


_stream: list[_SampleStream] = []  # the current op's, alone: a sweep takes the ops in turn


def _samples(key: str, n: int | None) -> list:
    """The first ``n`` samples of op ``key`` (all with None)."""
    if not _stream or _stream[0].key != key:
        _stream[:] = [_SampleStream(key)]
    return _stream[0].first(n)


def selected_samples(
    key: str, layout: SweepLayout, limit: int | None, indices: Sequence[int] | None = None
) -> list[tuple]:
    """``(index, sample, layout of its first tensor or None)`` for the samples of op ``key``
    to run on ``layout``: those of ``indices`` if given (the op's that exist), else every
    sample (``limit`` None), else the first ``limit`` whose first tensor can be sharded that
    way, among the first ``4 * limit + 4`` (the first 64 when those hold none: some ops'
    first samples are all scalars or empty)."""
    if indices is not None:
        samples = _samples(key, max(indices, default=-1) + 1)
        return [
            (i, samples[i], _layout_of(key, i, samples[i], layout))
            for i in indices
            if i < len(samples)
        ]
    if limit is None:
        return [(i, s, _layout_of(key, i, s, layout)) for i, s in enumerate(_samples(key, None))]
    chosen = []
    for index in itertools.count():
        if index == 64 or (chosen and index == 4 * limit + 4):
            break
        samples = _samples(key, index + 1)
        if len(samples) <= index:
            break
        sharded = _layout_of(key, index, samples[index], layout)
        if sharded is not None:
            chosen.append((index, samples[index], sharded))
            if len(chosen) == limit:
                break
    return chosen


def _layout_of(key: str, index: int, sample, layout: SweepLayout) -> Layout | None:
    """None also for a sparse first tensor: ShardTensors shard strided tensors only."""
    first, _ = _first_tensor(sample)
    if first is None or first.layout != torch.strided:
        return None
    return layout.layout_for(first.shape, salt=f"{key}/{index}")


@dataclass(frozen=True)
class Expectations:
    """What ``op_db_unsupported.py`` says: the errors an op may raise and the cases of known
    bugs (by sample, layout and message, with why), and ops whose output values are random
    or uninitialised (only shapes and layouts are compared), always or in some samples."""

    unsupported: dict[str, tuple]
    unchecked_values: dict[str, str]
    random_when: dict[str, Callable[[object], bool]]
    known_bugs: dict[str, tuple] = field(default_factory=dict)
    families: dict[str, tuple[str, frozenset[str]]] = field(default_factory=dict)

    @classmethod
    def load(cls) -> Expectations:
        from tests import op_db_unsupported

        return cls(
            op_db_unsupported.UNSUPPORTED,
            op_db_unsupported.VALUES_NOT_COMPARED,
            op_db_unsupported.RANDOM_WHEN,
            op_db_unsupported.KNOWN_BUGS,
            op_db_unsupported.GATHERED_FAMILIES,
        )

    def entries(self, op: str) -> tuple:
        return (*self.unsupported.get(op, ()), *self.known_bugs.get(op, ()))

    def listed_cases(self) -> dict[str, dict[str, tuple[int, ...] | None]]:
        """Op -> layout name -> the samples its entries apply to there (None: every sample),
        for the ops that have entries."""
        listed: dict[str, dict[str, tuple[int, ...] | None]] = {}
        for op in {*self.unsupported, *self.known_bugs}:
            per_layout: dict[str, tuple[int, ...] | None] = {}
            for entry in self.entries(op):
                for name in entry.layouts or tuple(LAYOUTS):
                    known = per_layout.get(name, ())
                    if entry.samples is None or known is None:
                        per_layout[name] = None
                    else:
                        per_layout[name] = tuple(sorted({*known, *entry.samples}))
            listed[op] = per_layout
        return listed

    def hangs(self, op: str, sample: int, layout: str) -> bool:
        """Whether a known bug leaves some ranks waiting in this case (a timeout and a fresh
        pool: a minute or more)."""
        case = {"sample": sample, "layout": layout}
        return any(
            e.outcome == "some-ranks" and e.applies(case) for e in self.known_bugs.get(op, ())
        )

    def why_values_unchecked(self, key: str, sample) -> str | None:
        """Why the values of this sample's outputs cannot be compared, or None."""
        if key in self.unchecked_values:
            return f"values {self.unchecked_values[key]}"
        if key in self.random_when and self.random_when[key](sample):
            return "values random in this sample"
        return None

    def accepting(self, record: dict) -> object | None:
        """The entry (unsupported or known bug) that accepts this case, or None."""
        return next((e for e in self.entries(record["op"]) if e.accepts(record)), None)


# ---------------------------------------------------------------------------- arguments
def _first_tensor(sample) -> tuple[torch.Tensor | None, Callable]:
    """The sample's first tensor argument and a function putting a replacement in its
    place: ``rebuild(x) -> (input, args)``."""
    if isinstance(sample.input, torch.Tensor):
        return sample.input, lambda x: (x, sample.args)
    if isinstance(sample.input, (list, tuple)) and sample.input:
        first = sample.input[0]
        if isinstance(first, torch.Tensor):
            rest = list(sample.input[1:])
            return first, lambda x: (type(sample.input)([x, *rest]), sample.args)
    return None, lambda x: (sample.input, sample.args)


def _is_sequence(value: object) -> bool:
    return isinstance(value, (list, tuple)) and not hasattr(value, "_fields")


def _tensors_in(value: object) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested lists, tuples and dicts), in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if _is_sequence(value):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def _with_tensors(value: object, tensors: Iterator[torch.Tensor]) -> object:
    """``value`` with its tensors replaced, in ``_tensors_in``'s order, by ``tensors``."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if _is_sequence(value):
        return type(value)(_with_tensors(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _with_tensors(v, tensors) for k, v in value.items()}
    return value


def _rest(sample, rebuild: Callable, x: torch.Tensor) -> tuple:
    """``(the input's other elements, args, kwargs)``: where the other tensor arguments are."""
    inputs, args = rebuild(x)
    rest = list(inputs[1:]) if isinstance(inputs, (list, tuple)) else []
    return rest, args, sample.kwargs


def other_tensors(sample) -> list[torch.Tensor]:
    """Every tensor argument of the sample but the first, in a fixed order."""
    first, rebuild = _first_tensor(sample)
    if first is None:
        return []
    return _tensors_in(_rest(sample, rebuild, first))


def _differentiable(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def _call(op, sample, rebuild: Callable, x: torch.Tensor, others=None) -> object:
    """Run the op with ``x`` in place of the first tensor argument and ``others`` in place of
    the other tensor arguments (default: fresh, gradient-free copies)."""
    if others is None:
        others = [t.detach().clone() for t in other_tensors(sample)]
    inputs, _ = rebuild(x)
    rest, args, kwargs = _with_tensors(_rest(sample, rebuild, x), iter(others))
    if isinstance(inputs, (list, tuple)):
        inputs = type(inputs)([inputs[0], *rest])
    return op(inputs, *args, **kwargs)


def _flat_outputs(out: object) -> list:
    if isinstance(out, (list, tuple)):
        return [leaf for item in out for leaf in _flat_outputs(item)]
    return [out]


# ---------------------------------------------------------------------------- one case
@dataclass(frozen=True)
class CaseResult:
    """What one rank saw of a case that ran.

    Attributes
    ----------
    problem : str or None
        What differs from the reference (None: nothing found).
    unchecked : str or None
        What could not be checked, and why.
    layout : str
        How the outputs' layouts were stated: each output's rules (``depends``,
        ``same-shape``, ``-`` for an axis no rule states); on rank 0, which checks them.
    """

    problem: str | None
    unchecked: str | None = None
    layout: str = ""


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().clone().requires_grad_(grad and _differentiable(x))


# NOTE [Every rank runs a case's collectives]
# A rank that finds a problem must not stop early: its peers would wait in the next collective
# of the case (a full_tensor, the backward). So each check that can differ between ranks (a
# shard size, a value, the layout, which rank 0 alone checks) is recorded, every rank goes
# on through the same collectives, and the ranks stop together only after agreeing that some
# rank found a problem (``_on_any_rank``).
def run_case(op, sample, layout: Layout, mesh, unchecked_values: str | None) -> CaseResult:
    """Run one case on this rank against the reference (see the module docstring and NOTE
    [Every rank runs a case's collectives]).

    Raises whatever the sharded run raises; returns ``CaseResult("skip: ...")`` when the
    reference itself raises.
    """
    from shardsci.tensor._api import from_local_spec

    first, rebuild = _first_tensor(sample)
    grad = op.supports_autograd
    others = other_tensors(sample)
    reference_leaves = [_leaf(first, grad), *(_leaf(t, grad and t.requires_grad) for t in others)]
    try:
        expected = _call(op, sample, rebuild, reference_leaves[0], reference_leaves[1:])
    except Exception:
        return CaseResult("skip: the reference raised")
    spec = layout.spec(mesh, first)
    local = _leaf(spec.narrow(first.detach()), grad)
    leaves = [local, *(_leaf(t, grad and t.requires_grad) for t in others)]
    actual = _call(op, sample, rebuild, from_local_spec(local, spec), leaves[1:])

    expected_flat, actual_flat = _flat_outputs(expected), _flat_outputs(actual)
    if len(expected_flat) != len(actual_flat):
        return CaseResult(f"{len(actual_flat)} outputs, reference has {len(expected_flat)}")
    # A layout is the same on every rank (NOTE [Shard sizes are a global, rank-independent
    # table] in shardsci/tensor/_spec.py): rank 0 alone works out and checks the rules.
    rules = [[] for _ in expected_flat]
    if dist.get_rank() == 0:
        rules = _layout_rules(op, sample, rebuild, first, layout, tuple(mesh.shape), expected_flat)
    stated = " ".join(_rules_text(r, layout) for r in rules)
    found = [
        f"output {i}: {problem}"
        for i, (a, e) in enumerate(zip(actual_flat, expected_flat))
        for problem in _compare_output(a, e, rules[i], tuple(mesh.shape), not unchecked_values)
    ]
    if _on_any_rank(any(": shard of shape" in f for f in found)):  # no backward through them
        return CaseResult(" | ".join(found) or None, layout=stated)
    unchecked = unchecked_values
    if unchecked is None and any(leaf.requires_grad for leaf in reference_leaves):
        problems, unchecked = _gradient_problems(
            sample, expected, actual, leaves, reference_leaves, spec
        )
        found += problems
    return CaseResult(" | ".join(found) or None, unchecked, stated)


def _gradient_problems(
    sample, expected, actual, leaves: list, reference_leaves: list, spec
) -> tuple[list[str], str | None]:
    """What differs in the gradient of every differentiable tensor argument, after a
    backward of a random projection of the outputs; and why no gradient was checked, if
    none was (the reference's backward raised)."""
    process = sample.output_process_fn_grad
    expected_terms = _differentiable_outputs(_flat_outputs(process(expected)))
    actual_terms = _differentiable_outputs(_flat_outputs(process(actual)))
    if not expected_terms:
        return [], None
    generator = torch.Generator().manual_seed(7)
    projections = [torch.randn(e.shape, dtype=e.dtype, generator=generator) for e in expected_terms]
    try:
        _loss(expected_terms, projections).backward()
    except Exception as exc:
        return [], f"gradients: the reference's backward raised {type(exc).__name__}"
    sharded_projections = [_laid_out_like(p, a) for p, a in zip(projections, actual_terms)]
    _loss(actual_terms, sharded_projections).backward()
    found = []
    for i, (leaf, reference) in enumerate(zip(leaves, reference_leaves)):
        if not reference.requires_grad:
            continue
        expected_grad = _zero_if_none(reference.grad, reference)
        if i == 0:
            expected_grad = spec.narrow(expected_grad)
        problem = _mismatch(_whole(_zero_if_none(leaf.grad, leaf)), expected_grad)
        if problem:
            which = "the sharded input" if i == 0 else f"tensor argument {i}"
            found.append(f"gradient of {which}: {problem}")
    return found, None


def _on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank: a collective every rank calls at the same point."""
    count = torch.tensor([int(flag)])
    dist.all_reduce(count)
    return bool(count.item())


def _zero_if_none(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _whole(t: torch.Tensor) -> torch.Tensor:
    from shardsci.tensor import ShardTensor

    return t.full_tensor() if isinstance(t, ShardTensor) else t


def _layout_rules(
    op, sample, rebuild, first: torch.Tensor, layout: Layout, mesh: tuple, expected: list
) -> list[list[AxisRule]]:
    """Per output: the rules its layout must follow (NOTE [An output cell belongs to the
    shard it depends on]), with the layouts the op documents (NOTE [A layout an op documents
    over its dependencies])."""
    shardings = dim_shardings(layout, first.shape, mesh)

    def call(x: torch.Tensor) -> list:
        # Random ops draw the same numbers for every probe. (The CPU generator only:
        # torch.manual_seed also queues the seeding of every accelerator, at 3 ms a call.)
        torch.default_generator.manual_seed(0)
        return _flat_outputs(_call(op, sample, rebuild, x))

    owners_per_axis: dict[int, list[Dependence]] = {}
    for dim, (axes, sizes) in shardings.items():
        if len(axes) == 1:
            owners_per_axis[axes[0]] = cell_owners(call, first.detach(), dim, sizes) or []
    rules = []
    for i, e in enumerate(expected):
        if not isinstance(e, torch.Tensor):
            rules.append([])
            continue
        per_axis = {a: owners[i] for a, owners in owners_per_axis.items() if i < len(owners)}
        stated = axis_rules(per_axis, layout, first.shape, e.shape, mesh)
        rules.append(
            documented(op_key(op), stated, layout, first.ndim, first.shape, mesh, sample.kwargs, i)
        )
    return rules


def _rules_text(rules: list[AxisRule], layout: Layout) -> str:
    by_axis = {r.axis: r.text for r in rules}
    return "/".join(by_axis.get(a, "-") for a in range(len(layout.placements)))


def _differentiable_outputs(outputs: list) -> list[torch.Tensor]:
    return [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]


def _loss(outputs: list[torch.Tensor], projections: list) -> torch.Tensor:
    from shardsci.tensor import ShardTensor

    total = None
    for o, p in zip(outputs, projections):
        term = (o * p).sum()
        if isinstance(term, ShardTensor):
            term = term.full_tensor()
        if term.is_complex():
            term = term.real
        total = term if total is None else total + term
    return total


def _laid_out_like(projection: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    from shardsci.tensor import ShardTensor
    from shardsci.tensor._api import from_local_spec, grad_spec

    if not isinstance(out, ShardTensor):
        return projection
    spec = grad_spec(out._spec).with_dtype(projection.dtype)
    return from_local_spec(spec.narrow(projection), spec)


def _compare_output(
    actual: object, expected: object, rules: list[AxisRule], mesh: tuple, values: bool
) -> list[str]:
    """What differs in one output: its layout and its values, both checked; every rank makes
    the same collectives (NOTE [Every rank runs a case's collectives])."""
    from shardsci.tensor import ShardTensor

    if not isinstance(expected, torch.Tensor):
        if isinstance(actual, torch.Tensor):
            return [f"a tensor where the reference returned {expected!r}"]
        same = actual == expected or actual is expected
        return [] if same else [f"{actual!r} != {expected!r}"]
    if not isinstance(actual, torch.Tensor):
        return [f"{actual!r} where the reference returned a tensor"]
    found = []
    if isinstance(actual, ShardTensor):
        local, claimed = tuple(actual._local.shape), tuple(actual._spec.local_shape())
        wrong_shard = local != claimed
        if _on_any_rank(wrong_shard):  # a gather of wrong shards could hang: stop together
            wrong = f"shard of shape {local} where its spec says {claimed} ({actual._spec})"
            return [wrong] if wrong_shard else []
        layout = _layout_problem(actual, rules, mesh)
        if layout:
            found.append(f"layout: {layout}")
        with torch.no_grad():
            actual = actual.full_tensor()
    elif rules:
        found.append("layout: a plain tensor where the input's shards state a sharded output")
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        found.append(
            f"shape {tuple(actual.shape)} {actual.dtype}, reference "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    elif values and (mismatch := _mismatch(actual, expected)):
        found.append(mismatch)
    return found


def _layout_problem(actual, rules: list[AxisRule], mesh: tuple) -> str:
    spec = actual._spec
    if spec.mesh_shape != mesh:
        return f"on a mesh of shape {spec.mesh_shape}, the input's is {mesh}"
    sizes = {s.dim: s.sizes for s in spec.shardings}
    order = {s.dim: s.axes for s in spec.shardings}
    return held_where(rules, spec.placements, sizes, order, tuple(actual.shape), mesh)


def _mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    try:
        torch.testing.assert_close(
            actual.detach(), expected.detach(), atol=_ATOL, rtol=_RTOL, equal_nan=True
        )
    except AssertionError as exc:
        return " ".join(str(exc).split())[:300]
    return None


# ---------------------------------------------------------------------------- on the ranks
# Rank 0 logs each case before running it and its outcome after, to a file the parent reads,
# so a case during which a rank died or hung is known even though the pool call returns
# nothing (NOTE [Agreeing on a case's outcome] in tests/agreement.py).
Position = tuple[str, int, int]  # (op key, index of the layout in the call's list, sample)
_KNOWN_HANG = "a known bug hangs some ranks here: only the full sweep runs it"


def _cases(
    layouts: Sequence[SweepLayout],
    chunk: tuple[int, int],
    limit: int | None,
    pattern: str | None,
    resume_after: Position | None,
    dealt: bool = False,
    listed: Mapping[str, Mapping[str, tuple[int, ...] | None]] | None = None,
) -> Iterator[tuple[Position, SweepLayout, object, Layout | None]]:
    """``(position, layout, sample, layout of its first tensor)`` of every case of this chunk
    of the database (ops whose key matches ``pattern``) after ``resume_after``, op by op and,
    for each op, layout by layout (its samples are generated once, its caches stay warm).
    ``dealt``: each op on one layout only, the ``LAYOUTS`` in turn. ``listed``: only these
    ops, and of each, on each layout, only the samples it names there (None: every
    sample; a layout it does not name: none)."""
    keys = sorted(
        k
        for k in database()
        if (pattern is None or re.search(pattern, k)) and (listed is None or k in listed)
    )
    names = list(LAYOUTS)
    for number, key in enumerate(keys):
        if number % chunk[1] != chunk[0]:
            continue
        if resume_after is not None and key < resume_after[0]:
            continue
        for i, layout in enumerate(layouts):
            if dealt and names[number % len(names)] != layout.name:
                continue
            indices = None if listed is None else listed[key].get(layout.name, ())
            for index, sample, sharded in selected_samples(key, layout, limit, indices):
                if resume_after is None or (key, i, index) > resume_after:
                    yield (key, i, index), layout, sample, sharded


@dataclass(frozen=True)
class CaseNotes:
    """What a case's record notes beside its verdict.

    Attributes
    ----------
    layout_rules : str
        The layout rules checked (rank 0's; see ``CaseResult.layout``).
    gathers : tuple of str
        What the gather guard saw the sharded run gather, as ``"what: op [(backward of
        node)] before -> after bytes per rank"`` (NOTE [Gathers an op was not asked to make]
        in ``shardsci/tensor/_gather_guard.py``): the guard's own view, noted for finding
        such ops, never part of the verdict.
    """

    layout_rules: str = ""
    gathers: tuple[str, ...] = ()


def _noted(gather) -> str:
    backward = f" (backward of {gather.backward_of})" if gather.backward_of else ""
    return (
        f"{gather.what}: {gather.op}{backward} "
        f"{gather.bytes_per_rank_before} -> {gather.bytes_per_rank} bytes per rank"
    )


def _gathered_only(problem: str | None) -> bool:
    """Whether ``problem`` (one rank's, ``" | "``-separated) is only outputs replicated
    where they should be split."""
    from tests.op_db_unsupported import GATHERED_LAYOUT

    return problem is not None and all(re.match(GATHERED_LAYOUT, p) for p in problem.split(" | "))


_REFUSED = "refused"


def _under_error(key: str, sample, sharded: Layout, mesh, unchecked: str | None) -> str:
    """The case run again under ``gather_policy("error")``: ``_REFUSED`` where it raised
    ``GatherError``, else what it did."""
    from shardsci import GatherError, gather_policy

    try:
        with warnings.catch_warnings(), gather_policy("error"):
            warnings.simplefilter("ignore")
            run_case(database()[key], sample, sharded, mesh, unchecked)
    except GatherError:
        return _REFUSED
    except Exception as exc:
        return f"under gather_policy('error') it raised {type(exc).__name__}, not GatherError"
    return "under gather_policy('error') it ran"


def verdict_of_case(
    key: str, sample, sharded: Layout | None, mesh, unchecked: str | None
) -> tuple[tuple, CaseNotes]:
    """This rank's view of one case: ``("ran", problem, unchecked, guard)``, ``("raised",
    type, message)`` or ``("skip", why)``; and its notes (rank 0's: kept out of the verdict,
    so that the ranks' verdicts agree when nothing differs). ``guard``, where some rank's
    outputs are only gathered (``_gathered_only``): ``_REFUSED`` if the guard recorded a
    gather and ``gather_policy("error")`` refuses the case, else what it did (None
    elsewhere)."""
    from shardsci import gather_policy, record_gathers

    if sharded is None:
        return ("skip", "no tensor dim to shard in this layout"), CaseNotes()
    try:
        with warnings.catch_warnings(), gather_policy("allow"), record_gathers() as seen:
            warnings.simplefilter("ignore")
            result = run_case(database()[key], sample, sharded, mesh, unchecked)
    except Exception as exc:
        message = " ".join(str(exc).split())
        return ("raised", type(exc).__name__, message[:500]), CaseNotes()
    if result.problem and result.problem.startswith("skip: "):
        return ("skip", result.problem[len("skip: ") :]), CaseNotes()
    notes = CaseNotes(result.layout, tuple(dict.fromkeys(map(_noted, seen))))
    guard = None
    # The layout is rank 0's to check: the ranks agree before any of them runs the case again.
    if _on_any_rank(_gathered_only(result.problem)):
        seen_anywhere = _on_any_rank(bool(seen))
        guard = _under_error(key, sample, sharded, mesh, unchecked) if seen_anywhere else None
        guard = guard or "the gather guard saw no gather"
    return ("ran", result.problem, result.unchecked, guard), notes


def sweep_body(
    layout_names: Sequence[str],
    chunk: tuple[int, int],
    limit: int | None,
    resume_after: Position | None,
    log_path: str,
    pattern: str | None,
    dealt: bool = False,
    listed: Mapping[str, Mapping[str, tuple[int, ...] | None]] | None = None,
) -> None:
    """Run the cases of a chunk of the database after ``resume_after`` on this rank, on each
    of ``layout_names`` (their meshes of this world size; ``dealt``, ``listed``: see
    ``_cases``)."""
    layouts = [LAYOUTS[name] for name in layout_names]
    expectations = Expectations.load()
    rank = dist.get_rank()
    with open(log_path, "a") as log:
        for position, layout, sample, sharded in _cases(
            layouts, chunk, limit, pattern, resume_after, dealt, listed
        ):
            key, _, index = position
            case = {"op": key, "sample": index, "layout": layout.name, "position": position}
            if rank == 0:
                log.write(json.dumps({"begin": True, **case}) + "\n")
                log.flush()
            begun = time.perf_counter()
            unchecked = expectations.why_values_unchecked(key, sample)
            if limit is not None and expectations.hangs(key, index, layout.name):
                verdict, notes = ("skip", _KNOWN_HANG), CaseNotes()
            else:
                mesh = get_mesh(layout.mesh)
                verdict, notes = verdict_of_case(key, sample, sharded, mesh, unchecked)
            seconds = time.perf_counter() - begun
            verdicts = agree(verdict, f"{key} sample {index} on {layout.name}")
            if rank == 0:
                outcome, detail = classify(database()[key].name, verdicts)
                record = {
                    **case,
                    "outcome": outcome,
                    "detail": detail,
                    "layout_rules": notes.layout_rules,
                    "gathers": list(notes.gathers),
                }
                log.write(json.dumps({**record, "seconds": round(seconds, 4)}) + "\n")
                log.flush()


def classify(name: str, verdicts: list[tuple]) -> tuple[str, str]:
    """One case's outcome and its detail, from every rank's verdict (see the module
    docstring)."""
    kinds = {v[0] for v in verdicts}
    if kinds == {"skip"}:
        return "skipped", verdicts[0][1]
    if kinds == {"ran"}:
        problems = [(r, v[1]) for r, v in enumerate(verdicts) if v[1]]
        if problems:
            detail = "; ".join(f"rank {r}: {p}" for r, p in problems)
            guard = {v[3] for v in verdicts}
            if guard == {_REFUSED} and all(_gathered_only(p) for _, p in problems):
                return "gathered", detail
            said = sorted(g for g in guard if g not in (None, _REFUSED))
            return "wrong", " | ".join([detail, *said])
        unchecked = sorted({v[2] for v in verdicts if v[2]})
        if unchecked:
            return "not-checked", "; ".join(unchecked)
        return "ok", ""
    if kinds == {"raised"} and len({v[1] for v in verdicts}) == 1:
        message = f"{verdicts[0][1]}: {verdicts[0][2]}"
        return ("error" if names_op(name, verdicts[0][2]) else "unclear"), message
    detail = "; ".join(f"rank {r}: {v[1:]}" for r, v in enumerate(verdicts))
    return "some-ranks", detail


def names_op(name: str, message: str) -> bool:
    """Whether an error message says which op failed: an op overload (``aten.cumprod.default``,
    ``mylib::op``) or the OpInfo's function name (``hardtanh`` for
    ``nn.functional.hardtanh``)."""
    if re.search(r"\baten\.\w+|\b\w+\.\w+\.default\b|\w+::\w+", message):
        return True
    return name.split(".")[-1] in message


# ---------------------------------------------------------------------------- in the parent
def sweep(
    layouts: Sequence[SweepLayout],
    chunk: tuple[int, int] = (0, 1),
    limit: int | None = None,
    pattern: str | None = None,
    dealt: bool = False,
    listed: Mapping[str, Mapping[str, tuple[int, ...] | None]] | None = None,
) -> list[dict]:
    """Every case of a chunk of the database on ``layouts`` (meshes of one world size, run
    in one pool; ``dealt``: each op on one layout; ``listed``: only these ops' samples on
    each layout, see ``_cases``): one record per case with
    its ``op``, ``sample``, ``layout``, ``outcome``, ``detail``, ``layout_rules`` and
    ``seconds`` (on rank 0)."""
    worlds = {layout.world for layout in layouts}
    if len(worlds) != 1:
        raise ValueError(f"one sweep runs layouts of one world size, got {sorted(worlds)}")
    names = [layout.name for layout in layouts]
    with tempfile.TemporaryDirectory(prefix="shardsci-op-db-") as tmp:
        log_path = Path(tmp) / "cases.jsonl"
        log_path.touch()
        resume_after = None
        while True:
            try:
                run_on_ranks(
                    layouts[0].world,
                    sweep_body,
                    names,
                    chunk,
                    limit,
                    resume_after,
                    str(log_path),
                    pattern,
                    dealt,
                    listed,
                    timeout_s=3600.0,
                )
                break
            except RankFailure as failure:
                resume_after = _record_failure(log_path, failure)
        return [r for r in _read(log_path) if "outcome" in r]


def by_world() -> dict[int, list[SweepLayout]]:
    """The sweep layouts grouped by world size (one pool call each)."""
    groups: dict[int, list[SweepLayout]] = {}
    for layout in LAYOUTS.values():
        groups.setdefault(layout.world, []).append(layout)
    return groups


def _read(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in log_path.read_text().splitlines() if line]


def _record_failure(log_path: Path, failure: RankFailure) -> Position:
    """Log the case a failed pool call was running as ``some-ranks``; return its position."""
    records = _read(log_path)
    if not records or "begin" not in records[-1]:
        raise failure
    case = {k: records[-1][k] for k in ("op", "sample", "layout", "position")}
    lines = [
        line
        for line in str(failure).splitlines()
        if line.strip() and not line.startswith((" ", "Traceback"))
    ]
    detail = "a rank died or hung: " + " | ".join(lines)[:1500]
    with open(log_path, "a") as log:
        record = {**case, "outcome": "some-ranks", "detail": detail, "seconds": None}
        log.write(json.dumps({**record, "layout_rules": ""}) + "\n")
    return tuple(case["position"])


def counts(records: list[dict]) -> dict[str, int]:
    """Cases per outcome, plus ``cases`` (those not skipped), ``wrong_values`` (wrong cases
    with a wrong value or gradient, not only a wrong layout) and ``layout_unstated`` (cases
    that ran with some output axis no layout rule states)."""
    tally = Counter(r["outcome"] for r in records)
    result = {"cases": sum(n for o, n in tally.items() if o != "skipped")}
    result.update({o: tally.get(o, 0) for o in OUTCOMES})
    result["wrong_values"] = sum(1 for r in records if wrong_values(r))
    result["layout_unstated"] = sum(
        1
        for r in records
        if r["outcome"] in ("ok", "not-checked") and "-" in re.split(r"[ /]", r["layout_rules"])
    )
    return result


_NOT_OK = ("gathered", "wrong", "unclear", "some-ranks", "error")


def wrong_values(record: dict) -> bool:
    """Whether a wrong case has a wrong value, shard or gradient (not only a wrong layout, nor
    what the gather guard said of a replicated one)."""
    if record["outcome"] != "wrong":
        return False
    problems = re.split(r" \| |; rank \d+: |^rank \d+: ", record["detail"])
    layout_only = r"output \d+: layout: |the gather guard saw no gather$|under gather_policy\("
    return any(p and not re.match(layout_only, p) for p in problems)


def problems(records: list[dict], expectations: Expectations) -> list[str]:
    """Every case the sweep must not accept: wrong, unclear, some-ranks and error cases that
    no entry of ``op_db_unsupported.py`` accepts (another op, sample, layout or message)."""
    found = []
    for r in records:
        if r["outcome"] in _NOT_OK and expectations.accepting(r) is None:
            where = f"{r['op']} sample {r['sample']} on {r['layout']}"
            found.append(f"{where}: {r['outcome']}: {r['detail']}")
    return found


def stale(records: list[dict], expectations: Expectations) -> list[str]:
    """Entries of ``op_db_unsupported.py`` that accepted none of the cases of ``records``
    they apply to (an error that went away, a bug that was fixed: narrow or drop them)."""
    found = []
    for op in sorted({r["op"] for r in records}):
        mine = [r for r in records if r["op"] == op and r["detail"] != _KNOWN_HANG]
        for entry in expectations.entries(op):
            applying = [r for r in mine if entry.applies(r)]
            if applying and not any(entry.accepts(r) for r in applying):
                found.append(f"{op}: {entry}")
    return found


_COLUMNS = (
    ("ok", "ok"),
    ("not-checked", "not checked"),
    ("error", "clear error"),
    ("gathered", "gathered, said"),
    ("wrong", "wrong"),
    ("wrong_values", "of which values"),
    ("some-ranks", "some ranks"),
    ("unclear", "unclear"),
    ("skipped", "skipped"),
    ("layout_unstated", "layout unstated"),
)


def short_of_ok(records: list[dict], expectations: Expectations) -> list[dict]:
    """The cases short of ``ok`` and ``not-checked`` (but ``skipped``), one row per op, outcome
    and reason: ``op``, ``outcome``, ``samples`` (layout -> sample numbers) and ``reason``
    (the reason of the ``op_db_unsupported.py`` entry that accepts them, else ``"not listed:
    "`` and the first case's detail). The gathered cases of a family's ops
    (``GATHERED_FAMILIES``) make one row, with ``family`` (its name), ``ops`` and ``samples``
    (layout -> the number of cases), and the family's reason."""
    rows: dict[tuple[str, str, str], dict] = {}
    family_of = {op: name for name, (_, ops) in expectations.families.items() for op in ops}
    for r in records:
        if r["outcome"] in ("ok", "not-checked", "skipped"):
            continue
        family = family_of.get(r["op"]) if r["outcome"] == "gathered" else None
        if family is not None:
            row = rows.setdefault(
                (family, "gathered", "family"),
                {
                    "op": family,
                    "family": family,
                    "ops": [],
                    "outcome": "gathered",
                    "samples": {},
                    "reason": expectations.families[family][0],
                },
            )
            row["ops"] = sorted({*row["ops"], r["op"]})
            row["samples"][r["layout"]] = row["samples"].get(r["layout"], 0) + 1
            continue
        entry = expectations.accepting(r)
        reason = entry.reason if entry is not None else f"not listed: {r['detail'][:300]}"
        row = rows.setdefault(
            (r["op"], r["outcome"], reason if entry is not None else ""),
            {"op": r["op"], "outcome": r["outcome"], "samples": {}, "reason": reason},
        )
        row["samples"].setdefault(r["layout"], []).append(r["sample"])
    return sorted(rows.values(), key=lambda row: (row["outcome"], row["op"], row["reason"]))


def read_records(paths: Sequence[Path]) -> list[dict]:
    """The records of ``--records`` files, a later file's case replacing an earlier file's
    (the same op, sample and layout rerun)."""
    merged: dict[tuple, dict] = {}
    for path in paths:
        for record in _read(path):
            merged[(record["op"], record["sample"], record["layout"])] = record
    return list(merged.values())


def write_summary(
    path: Path,
    records: list[dict],
    samples: int | None,
    pattern: str | None,
    note: str = "",
) -> None:
    """``path.json`` and ``path.md``: the counts per layout of ``records``, how they were
    produced (``note``: where and when, on which commit), and every case short of ok with
    its reason."""
    layouts = {}
    for name in LAYOUTS:
        mine = [r for r in records if r["layout"] == name]
        if mine:
            layouts[name] = counts(mine)
    command = (
        "OMP_NUM_THREADS=1 python -m tests.op_db_sweep"
        + (f" --samples {samples}" if samples is not None else "")
        + (f" --ops '{pattern}'" if pattern else "")
        + f" --summary {path}"
    )
    short = short_of_ok(records, Expectations.load())
    summary = {
        "command": command,
        "torch": torch.__version__,
        "note": note,
        "ops": len({r["op"] for r in records}),
        "samples_per_op": samples or "all",
        "layouts": layouts,
        "short_of_ok": short,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = [
        f"| {name} | {t['cases']} | " + " | ".join(str(t[key]) for key, _ in _COLUMNS) + " |"
        for name, t in layouts.items()
    ]
    described = "; ".join(f"{n}: {LAYOUTS[n].description}" for n in layouts)
    path.with_suffix(".md").write_text(
        "# PyTorch's OpInfo database on ShardTensors\n\n"
        f"{summary['ops']} OpInfo entries (float64, CPU), the first "
        f"{summary['samples_per_op']} samples of each that a layout can shard, torch "
        f"{torch.__version__}; the first tensor argument sharded ({described}), the others "
        "plain; compared with one process: values, shard sizes, each output's layout (NOTE "
        "[An output cell belongs to the shard it depends on] in `tests/expected_layouts.py`) "
        "and the gradient of every differentiable tensor argument (see "
        "`tests/op_db_sweep.py`). *clear error*: the same error naming the op on every rank, "
        "each accepted by op, sample and message in `tests/op_db_unsupported.py`. *gathered, "
        "said*: right but for an output replicated where it should be split, a gather the "
        "guard recorded and `gather_policy('error')` refuses on every rank (each listed "
        "with its reason); a gather the guard misses is *wrong*. *not "
        "checked*: random or uninitialised values, or a reference whose backward raised. "
        "*layout unstated*: ok or not-checked cases with an output axis no rule states "
        "(a reduction or contraction over the sharded dim).\n\n"
        + (f"{note}\n\n" if note else "")
        + "| layout | cases | "
        + " | ".join(title for _, title in _COLUMNS)
        + " |\n| --- | --- |"
        + " --- |" * len(_COLUMNS)
        + "\n"
        + "\n".join(rows)
        + f"\n\nRegenerate: `{command}`\n\n"
        "## Cases short of ok\n\n"
        "Each with the reason its entry in `tests/op_db_unsupported.py` gives (entries name the "
        "samples the default test runs; *not listed*: a later sample of a listed op or "
        "layout, with its first problem). Samples per layout.\n\n"
        "| op | outcome | samples | reason |\n| --- | --- | --- | --- |\n"
        + "".join(
            f"| {_op_cell(row)} | {row['outcome']} | "
            + "; ".join(f"{n}: {_samples_cell(row, v)}" for n, v in row["samples"].items())
            + " | "
            + row["reason"].replace("|", "\\|")
            + " |\n"
            for row in short
        )
    )


def _op_cell(row: dict) -> str:
    if "family" not in row:
        return f"`{row['op']}`"
    return (
        f"*{row['family']}* ({len(row['ops'])} ops: "
        + ", ".join(f"`{op}`" for op in row["ops"])
        + ")"
    )


def _samples_cell(row: dict, samples) -> str:
    if "family" in row:
        return f"{samples} case" + "s" * (samples != 1)
    return ", ".join(map(str, samples))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=[*LAYOUTS, "all"], default="all")
    parser.add_argument("--samples", type=int, default=None, help="samples per op (default all)")
    parser.add_argument("--ops", default=None, help="regex on op keys (default all)")
    parser.add_argument("--records", type=Path, default=None, help="write every case here")
    parser.add_argument(
        "--summary", type=Path, default=None, help="write the counts to PATH.json and PATH.md"
    )
    parser.add_argument(
        "--from-records",
        type=Path,
        nargs="+",
        default=None,
        help="run nothing: summarise these --records files (a later file's cases replace an "
        "earlier one's)",
    )
    parser.add_argument("--note", default="", help="a paragraph for the summary: where, when")
    args = parser.parse_args(argv)
    if args.from_records:
        records = read_records(args.from_records)
        write_summary(args.summary, records, args.samples, args.ops, args.note)
        return
    expectations = Expectations.load()
    groups = by_world() if args.layout == "all" else {0: [LAYOUTS[args.layout]]}
    everything = []
    try:
        for layouts in groups.values():
            records = sweep(layouts, (0, 1), args.samples, args.ops)
            everything.extend(records)
            for layout in layouts:
                mine = [r for r in records if r["layout"] == layout.name]
                print(json.dumps({"layout": layout.name, **counts(mine)}), flush=True)
            for line in problems(records, expectations):
                print("  " + line, flush=True)
            if args.records:
                args.records.write_text("".join(json.dumps(r) + "\n" for r in everything))
    finally:
        from shardsci.testing import shutdown_pools

        shutdown_pools()
    if args.summary:
        write_summary(args.summary, everything, args.samples, args.ops, args.note)


if __name__ == "__main__":
    main(sys.argv[1:])
