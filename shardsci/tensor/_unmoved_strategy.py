"""DTensor's choice for an op whose operands need not move, found without its full expansion.

# NOTE [An op whose operands need not move skips DTensor's full strategy expansion]
DTensor (torch 2.13) writes most pointwise rules for one mesh axis and expands them to the
mesh by enumerating every combination of them, S**N for S rules over N axes, pricing each
operand's redistribution in each (``expand_to_full_mesh_op_strategy``): about a thousand
combinations on a 3-axis mesh, a large share of a second of CPU on every rank for each new
layout of one op (``benchmarks/unmoved_strategy.py``). Where some combination moves no operand,
DTensor picks one of those whatever the others cost (redistribution costs are never negative;
among several it takes the last in enumeration order, ``_select_min_cost_strategy``). Such a
combination uses, on each axis, a rule whose inputs are the operands' placements on that
axis. So the expansion of only the rules that match the operands on some axis, kept in their
order, holds every combination that moves nothing, in the same relative order, with the same
specs and costs: DTensor's own expansion and selection then pick the same one. That is tried
first; where it holds no such combination (an operand must move) DTensor's full expansion
runs. Operands with a ``_StridedShard`` or a non-default shard order, and lists of tensors,
always take the full expansion (equal placements need not cost nothing there). The choice is
checked against the full expansion on random layouts in ``tests/test_unmoved_strategy.py``.
The expansion is DTensor's own, so plain DTensors gain the same speed; torch 2.11 and 2.12
keep theirs (``install``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardsci.tensor import _torch_compat as compat  # 2.13's names, resolved on 2.13 only

__all__ = ["dtensor_expansion", "install", "unmoved_strategy"]

_FULL: Callable[..., Any] | None = None  # DTensor's own expansion, kept by ``install``


def install() -> bool:
    """Put the search for an unmoved combination in front of DTensor's single-dim expansion
    (once; torch 2.13 only). Whether it is in place."""
    global _FULL
    if compat.torch_release() < (2, 13):
        return False
    if _FULL is None:
        _FULL = compat.dtensor_sharding_prop._expand_single_dim_strategy_to_mesh
        compat.dtensor_sharding_prop._expand_single_dim_strategy_to_mesh = _expand
    return True


def dtensor_expansion() -> Callable[..., Any]:
    """DTensor's own ``_expand_single_dim_strategy_to_mesh``, whether or not ``install`` ran."""
    return _FULL or compat.dtensor_sharding_prop._expand_single_dim_strategy_to_mesh


def _expand(mesh: Any, op_schema: Any, strategy_info: Any, output_tensor_meta: Any) -> Callable:
    """The strategy function ``_expand_single_dim_strategy_to_mesh`` returns, trying the
    unmoved combinations first (NOTE above)."""

    def expanded(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
        found = unmoved_strategy(mesh, op_schema, strategy_info, output_tensor_meta)
        if found is not None:
            return found
        full = dtensor_expansion()(mesh, op_schema, strategy_info, output_tensor_meta)
        return full(op, args_schema, kwargs_schema)

    return expanded


def unmoved_strategy(
    mesh: Any, op_schema: Any, strategy_info: Any, output_tensor_meta: Any
) -> Any | None:
    """DTensor's expansion of only the single-axis rules whose inputs are the operands'
    placements on some axis, if it holds a combination that moves no operand; else None.

    Parameters
    ----------
    mesh : DeviceMesh
        The op's mesh, of N axes.
    op_schema : OpSchema
        The op's arguments, each tensor an ``OpStrategy`` of one spec (its current layout).
    strategy_info : _SingleDimStrategyInfo
        The op's rules for one mesh axis, as DTensor registered them.
    output_tensor_meta : TensorMeta or sequence of them
        The outputs' global shapes, as DTensor computed them.
    """
    if any(isinstance(a, compat.TupleStrategy) for a in op_schema.args_schema):
        return None
    operands = (*op_schema.args_strategy, *op_schema.kwargs_strategy)
    current = [operand.strategies[0].output_spec for operand in operands]
    if not current or not all(_plainly_ordered(spec) for spec in current):
        return None
    prepared = compat._PreparedSingleDimStrategy(strategy_info, op_schema, output_tensor_meta)
    outputs = prepared.num_outputs
    matching = []
    for rule in prepared.expanded_strategies:
        inputs = [p for p in rule[outputs:] if p is not None]
        if len(inputs) != len(current):
            return None
        if any(
            all(p == spec.placements[axis] for p, spec in zip(inputs, current))
            for axis in range(mesh.ndim)
        ):
            matching.append(rule)
    if not matching:
        return None
    found = compat.expand_to_full_mesh_op_strategy(
        prepared.element_mesh or mesh,
        op_schema,
        matching,
        output_tensor_meta=output_tensor_meta,
        inplace_op=op_schema.op.name().split("::")[1].split(".")[0].endswith("_"),
        input_index=outputs,
        allow_unbacked_sharding=prepared.allow_unbacked_sharding,
        allow_uneven_sharding=prepared.allow_uneven_sharding,
        different_mesh_args=prepared.remapped_different_mesh_args,
    )
    unmoved = any(
        all(t.placements == s.placements for t, s in zip(spec.input_specs, current))
        and sum(c for costs in spec.redistribute_cost for c in costs) == 0
        for spec in found.strategies
    )
    return found if unmoved else None


def _plainly_ordered(spec: Any) -> bool:
    """No ``_StridedShard`` and the default shard order: equal placements cost nothing."""
    return not any(isinstance(p, compat._StridedShard) for p in spec.placements) and (
        spec.shard_order == compat.DTensorSpec.compute_default_shard_order(spec.placements)
    )
