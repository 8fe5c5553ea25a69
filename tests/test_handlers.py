"""The handler-author API (``shardsci.handlers``): argument binding, the ``accepts`` guard,
duplicate-registration warnings, scoped registration, the public ``local``/``spec`` of a
ShardTensor, the checked ``from_local_spec``, and the how-to's example handler
(``docs/handlers.md``), run as written there against the single-process reference on uneven
and empty shards; and that every handler of the library binds with ``bind`` and declines
through ``accepts``.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.handlers import (
    DuplicateHandlerWarning,
    ShardTensor,
    accepts,
    bind,
    from_local_spec,
    register_aten_handler,
    register_function_handler,
    scoped_handlers,
)
from shardsci.tensor._binding import replaced
from shardsci.tensor._registry import (
    aten_handler_for,
    function_handler_for,
    registered_handlers,
)
from shardsci.testing import (
    Layout,
    RankFailure,
    assert_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)

HOWTO = Path(__file__).resolve().parents[1] / "docs" / "handlers.md"
aten = torch.ops.aten


def _example_source() -> str:
    """The first Python block of the how-to's example section, verbatim."""
    section = HOWTO.read_text().split("## Example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


# ---------------------------------------------------------------------------- bind
def test_bind_reads_an_aten_schema():
    x = torch.ones(3)
    a = bind(aten.cumsum.default, (x, 0), {"dtype": torch.float64})
    assert dict(a) == {"self": x, "dim": 0, "dtype": torch.float64}
    assert a.dim == 0 and a["dtype"] is torch.float64


def test_bind_reads_a_python_signature_and_fills_defaults():
    x = torch.ones(3)
    a = bind(F.interpolate, (x,), {"scale_factor": 2})
    assert (a.size, a.scale_factor, a.mode, a.antialias) == (None, 2, "nearest", False)


def test_bind_reads_a_builtin_by_its_aten_schema_with_input_for_self():
    x = torch.ones(3)
    positional = bind(F.avg_pool2d, (x, 2, None, 1), {})
    keywords = bind(F.avg_pool2d, (), {"input": x, "kernel_size": 2, "padding": 1})
    assert positional.input is x and keywords.input is x
    assert positional.padding == keywords.padding == 1
    assert positional.count_include_pad is True


def test_bind_takes_an_explicit_signature_for_an_opaque_callable():
    x = torch.ones(3)
    with pytest.raises(TypeError, match=r"max_pool2d.*\(\*args, \*\*kwargs\).*signature="):
        bind(F.max_pool2d, (x, 2), {})
    a = bind(F.max_pool2d, (x, 2), {"ceil_mode": True}, signature=F.max_pool2d_with_indices)
    assert (a.kernel_size, a.stride, a.ceil_mode, a.return_indices) == (2, None, True, False)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {"kernel_size": 2}, "missing required argument 'input'"),
        ((1, 2), {"kernel_size": 2}, "got multiple values for argument 'kernel_size'"),
        ((1, 2), {"kernel": 2}, "got an unexpected keyword argument 'kernel'"),
        ((1,) * 8, {}, "takes 7 positional arguments but 8 were given"),
    ],
)
def test_bind_rejects_a_bad_call_naming_the_callee(args, kwargs, message):
    with pytest.raises(TypeError, match=re.escape(f"avg_pool2d() {message}")):
        bind(F.avg_pool2d, args, kwargs)


def test_bind_collects_variadic_operands_and_reads_out_of_a_builtin():
    x = torch.ones(2)

    def einsum(equation, *operands): ...

    a = bind(torch.einsum, ("i,i->", x, x), {}, signature=einsum)
    assert a.equation == "i,i->" and a.operands == (x, x)
    assert bind(torch.einsum, ("i->",), {}, signature=einsum).operands == ()
    with pytest.raises(TypeError, match=r"einsum\(\) got an unexpected keyword argument 'x'"):
        bind(torch.einsum, ("i->",), {"x": x}, signature=einsum)
    # torch.index_select has an out= variant: out is a keyword of the builtin.
    assert bind(torch.index_select, (x, 0, x.long()), {}).out is None
    assert bind(torch.index_select, (x, 0, x.long()), {"out": x}).out is x


def test_replaced_rewrites_an_argument_where_the_caller_passed_it():
    x, y = torch.ones(2), torch.zeros(2)
    assert replaced(F.avg_pool1d, (x, 2), {}, {"input": y}) == ((y, 2), {})
    assert replaced(F.avg_pool1d, (), {"input": x}, {"input": y}) == ((), {"input": y})
    args, kwargs = replaced(F.avg_pool1d, (x, 2), {}, {"padding": 1})
    assert args == (x, 2) and kwargs == {"padding": 1}
    with pytest.raises(TypeError, match="avg_pool1d\\(\\) has no argument 'pad'"):
        replaced(F.avg_pool1d, (x, 2), {}, {"pad": 1})


def test_an_unknown_argument_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no argument named 'dims'"):
        bind(aten.cumsum.default, (torch.ones(2), 0), {}).dims  # noqa: B018


def test_library_handlers_read_their_arguments_only_through_bind():
    """No positional reads (``args[0]``, ``x, y = args``) and no other binder in the library's
    handlers: a keyword argument would be missed, or read from the wrong position."""
    positional = re.compile(r"\bargs\[|^\s*[\w, ]+=\s*args\s*$|\b(_parse|_bound|_bind|arg)\(")
    ops = Path(__file__).resolve().parents[1] / "shardsci" / "tensor" / "_ops"
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(ops.glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if positional.search(line)
    ]
    assert not found, "\n".join(found)


# ---------------------------------------------------------------------------- accepts
def _accepts_body() -> list[str]:
    """Each condition of ``accepts`` on a (B, C, W) tensor sharded along W on 2 ranks."""
    mesh = get_mesh((2,))
    whole = torch.randn(2, 3, 4, dtype=torch.float64)
    x = ShardTensor.from_local(whole.chunk(2, -1)[dist.get_rank()], mesh, [Shard(2)])
    partial = ShardTensor.from_local(whole, mesh, [Partial()])
    weight = ShardTensor.from_local(torch.ones(3), mesh, [Replicate()])
    integers = ShardTensor.from_local(torch.ones(2, 2, dtype=torch.int64), mesh, [Shard(1)])
    plain = torch.ones(3)
    cases = {
        "a ShardTensor": (accepts(x), True),
        "plain tensors and None only": (accepts(plain, None), False),
        "a ShardTensor among plain operands": (accepts(plain, x), True),
        "the sharded dim": (accepts(x, sharded=[2]), True),
        "the sharded dim from the end": (accepts(x, sharded=[-1]), True),
        "whole dims as sharded": (accepts(x, sharded=[0, 1]), False),
        "no dims as sharded": (accepts(x, sharded=[]), False),
        "a dim it lacks as sharded": (accepts(x, sharded=[5]), False),
        "sharded in another operand": (accepts(plain, x, sharded=[2]), True),
        "a whole dim as whole": (accepts(x, whole=[1]), True),
        "the sharded dim as whole": (accepts(x, whole=[-1]), False),
        "a dim it lacks as whole": (accepts(x, whole=[3]), False),
        "a Partial operand": (accepts(partial), False),
        "a Partial operand, partial=True": (accepts(partial, partial=True), True),
        "a Partial parameter": (accepts(x, replicated=[partial]), False),
        "a Partial parameter, partial=True": (accepts(x, replicated=[partial], partial=True), True),
        "integers, floating=True": (accepts(integers, floating=True), False),
        "floats, floating=True": (accepts(x, floating=True), True),
        "replicated parameters": (accepts(x, replicated=[weight, None, plain]), True),
        "a sharded parameter": (accepts(x, replicated=[x]), False),
        "plain statistics": (accepts(x, plain=[plain, None]), True),
        "ShardTensor statistics": (accepts(x, plain=[weight]), False),
    }
    return [f"{what}: {got}" for what, (got, expected) in cases.items() if got != expected]


def test_accepts_decides_from_layouts():
    for wrong in run_on_ranks(2, _accepts_body):
        assert not wrong, wrong


# ---------------------------------------------------------------------------- registration
def _first(func, args, kwargs):
    return NotImplemented


def _second(func, args, kwargs):
    return NotImplemented


def test_scoped_handlers_undo_new_and_replaced_registrations():
    existing = aten_handler_for(aten.cumsum.default)
    assert existing is not None
    with scoped_handlers():
        register_aten_handler("shardsci_test::op")(_first)
        register_function_handler(torch.special.erfcx)(_first)
        register_aten_handler(aten.cumsum.default, replace=True)(_second)
        assert aten_handler_for(aten.cumsum.default) is _second
        assert function_handler_for(torch.special.erfcx) is _first
    assert aten_handler_for(aten.cumsum.default) is existing
    assert function_handler_for(torch.special.erfcx) is None
    with scoped_handlers():
        from shardsci.tensor import _registry

        assert "shardsci_test::op" not in _registry._ATEN


def test_a_second_handler_for_an_op_warns_unless_replace_is_given():
    with scoped_handlers():
        register_function_handler(torch.special.erfcx)(_first)
        with pytest.warns(DuplicateHandlerWarning, match=r"erfcx.*_first.*_second.*replace=True"):
            register_function_handler(torch.special.erfcx)(_second)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            register_function_handler(torch.special.erfcx, replace=True)(_first)
            register_function_handler(torch.special.erfcx)(_first)  # the same handler again
        with pytest.warns(DuplicateHandlerWarning, match="cumsum"):
            register_aten_handler(aten.cumsum.default)(_second)


def test_importing_shardsci_registers_no_op_twice(tmp_path):
    import subprocess
    import sys

    probe = "import shardsci, shardsci.handlers, shardsci.graph, shardsci.parallel"
    result = subprocess.run(
        [sys.executable, "-W", "error::shardsci.handlers.DuplicateHandlerWarning", "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-2000:]


# ---------------------------------------------------------------------------- on ranks
def _counting(handler, calls):
    def counted(func, args, kwargs):
        result = handler(func, args, kwargs)
        calls.append(result is not NotImplemented)
        return result

    return counted


def _example_on_ranks(mesh_shape: tuple[int, ...], layouts: list[Layout]) -> None:
    mesh = get_mesh(mesh_shape)
    x = torch.randn(9, 6, dtype=torch.float64)
    with scoped_handlers():
        namespace: dict = {}
        exec(_example_source(), namespace)  # registers the example, as a user's module would
        calls: list[bool] = []
        register_function_handler(F.normalize, replace=True)(
            _counting(namespace["sharded_normalize"], calls)
        )
        cases = {
            "dim 0": lambda t: F.normalize(t, dim=0),
            "dim 1, p=3": lambda t: F.normalize(t, p=3.0, dim=1, eps=1e-3),
            "p=1, dim -2": lambda t: F.normalize(t, 1.0, -2),
        }
        for layout in layouts:
            for what, fn in cases.items():
                check_against_reference(fn, [x], [layout], mesh, what=f"{what} on {layout}")
        assert_all_ranks(calls == [True] * (3 * len(layouts)), f"handler calls {calls}")
        check_against_reference(lambda t: F.normalize(t, p=math.inf, dim=0), [x], layouts[:1], mesh)
        assert_all_ranks(calls[-1] is False, "p=inf must be declined")
    assert_all_ranks(function_handler_for(F.normalize) is None, "the handler outlived its scope")


def test_the_howto_example_matches_the_reference_on_two_uneven_ranks():
    run_on_ranks(2, _example_on_ranks, (2,), [Layout((Shard(0),), {0: (5, 4)})])


def test_the_howto_example_matches_the_reference_on_empty_shards_and_a_2x2_mesh():
    run_on_ranks(4, _example_on_ranks, (4,), [Layout((Shard(0),), {0: (3, 0, 4, 2)})])
    blocks = Layout((Shard(0), Shard(1)), {0: (5, 4), 1: (2, 4)})
    rows_over_both_axes = Layout((Shard(0), Shard(0)), {0: (2, 1, 0, 6)})
    run_on_ranks(4, _example_on_ranks, (2, 2), [blocks, rows_over_both_axes])


def _public_local_spec_and_checked_result() -> None:
    mesh = get_mesh((2,))
    x = torch.randn(7, 3, dtype=torch.float64)
    sizes = (4, 3)
    spec = Layout((Shard(0),), {0: sizes}).spec(mesh, x)
    local = spec.narrow(x)
    y = from_local_spec(local.float().requires_grad_(), spec)
    assert_all_ranks(y.local.shape == spec.local_shape() and y.spec.dtype == torch.float32)
    assert_all_ranks(isinstance(y, ShardTensor) and y.spec.placements == (Shard(0),))
    y.to_local().sum().backward()
    assert_raises_all_ranks(
        ValueError,
        r"result shard has shape \(7, 3\), but its spec .* shard of shape \([43], 3\)",
        from_local_spec,
        x,
        spec,
    )
    replicated = Layout((Replicate(),)).spec(mesh, x)
    assert_all_ranks(from_local_spec(x, replicated).local is not None)


def test_public_local_and_spec_and_the_checked_result_builder():
    run_on_ranks(2, _public_local_spec_and_checked_result)


def _leaks_a_handler() -> None:
    register_aten_handler("shardsci_test::leaked")(_first)


def _leaked_handler_is_gone() -> bool:
    return "shardsci_test::leaked" not in registered_handlers()


def test_a_handler_that_outlives_its_rank_body_fails_the_test():
    with pytest.raises(RankFailure, match=r"shardsci_test::leaked -> tests\.test_handlers\._first"):
        run_on_ranks(2, _leaks_a_handler)
    assert run_on_ranks(2, _leaked_handler_is_gone) == [True, True]  # the pool was replaced
