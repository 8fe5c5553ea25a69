"""Private PyTorch symbols (NOTE [Private PyTorch symbols live in _torch_compat]): the library
reaches them only through ``shardsci.tensor._torch_compat``, each one has a smoke test of what
shardsci relies on, and a missing one fails with a message naming it and the torch version.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardsci.tensor import ShardTensor, _torch_compat
from shardsci.tensor._torch_compat import PRIVATE_SYMBOLS, PrivateSymbol, TorchCompatError

LIBRARY = Path(__file__).resolve().parents[1] / "shardsci"
COMPAT = LIBRARY / "tensor" / "_torch_compat.py"


# ---------------------------------------------------------------------------- the scan
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    """``torch._C._x`` -> ("torch", ["_C", "_x"]); None when not rooted at a name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value  # type: ignore[assignment]
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def private_torch_uses(source: str) -> list[str]:
    """``line: what`` for each private torch import or attribute chain in ``source``: a
    module path or imported name with a leading underscore, or an attribute with one read
    from a name bound by a torch import (``torch.ops`` excluded: aten op names such as
    ``_softmax`` are not Python API)."""
    tree = ast.parse(source)
    torch_names: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    continue
                torch_names.add(alias.asname or "torch")
                if any(_private(p) for p in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            for alias in node.names:
                torch_names.add(alias.asname or alias.name)
                if any(_private(p) for p in [*module.split("."), alias.name]):
                    found.append(f"{node.lineno}: from {module} import {alias.name}")
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        if chain is None or chain[0] not in torch_names:
            continue
        root, attrs = chain
        if root == "torch" and attrs[0] == "ops":
            continue
        if any(_private(a) for a in attrs):
            found.append(f"{node.lineno}: {root}.{'.'.join(attrs)}")
    return sorted(set(found))


def test_library_reaches_private_torch_only_through_the_compat_module():
    uses = {
        str(path.relative_to(LIBRARY.parent)): private_torch_uses(path.read_text())
        for path in sorted(LIBRARY.rglob("*.py"))
        if path != COMPAT
    }
    offenders = {path: found for path, found in uses.items() if found}
    assert not offenders, (
        f"private torch symbols used outside shardsci/tensor/_torch_compat.py: {offenders}; "
        "add them to PRIVATE_SYMBOLS there (with a smoke test here) and import them from it"
    )


@pytest.mark.parametrize(
    "source",
    [
        "from torch.distributed.tensor._dtensor_spec import DTensorSpec",
        "from torch.distributed.tensor import _redistribute",
        "import torch.distributed._functional_collectives as funcol",
        "import torch\ntorch._C._current_graph_task_id()",
        "from torch.distributed.tensor import DTensor\nDTensor._op_dispatcher",
        "import torch.distributed as dist\ndist.distributed_c10d._world",
    ],
)
def test_the_scan_finds_each_kind_of_private_use(source):
    assert private_torch_uses(source), source


def test_the_scan_lets_public_api_and_aten_op_names_through():
    source = (
        "import torch\nfrom torch.distributed.tensor import Shard\n"
        "torch.ops.aten._softmax.default\nShard(0).__class__\nx._local\n"
    )
    assert private_torch_uses(source) == []


# ---------------------------------------------------------------------------- smoke tests
def _parameters(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _has(*names: str) -> Callable[[object], None]:
    def check(value: object) -> None:
        missing = [n for n in names if not hasattr(value, n)]
        assert not missing, f"{value!r} lacks {missing}"

    return check


def _takes(*names: str) -> Callable[[object], None]:
    def check(value: object) -> None:
        params = _parameters(value)  # type: ignore[arg-type]
        assert params[: len(names)] == list(names), f"{value!r} takes {params}"

    return check


def _aot_graph_compile(module: object) -> None:
    _takes("joint_gm", "joint_inputs", "aot_config")(module.run_joint_graph_passes_on_hops)
    _takes("aot_state", "aot_graph_capture")(module.aot_stage2_autograd)


def _native_batch_norm_legit(fn: Callable) -> None:
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    out, mean, inverse_std = fn(x, None, None, True, 0.1, 1e-5)
    assert out.shape == x.shape and mean.shape == inverse_std.shape == (3,)


def _view_rules(_: object) -> None:
    c = _torch_compat
    assert c.infer_size(12, (3, -1)) == (3, 4)
    (flat,) = c.view_groups((2, 3), (6,))
    assert isinstance(flat, c.Flatten)
    assert [d.input_dim for d in flat.input_dims] == [0, 1]
    assert all(isinstance(d, c.InputDim) for d in flat.input_dims)
    splits = c.view_groups((6,), (2, 3))
    assert [type(s) for s in splits] == [c.Split, c.Split]
    assert [(s.group_shape, s.split_id) for s in splits] == [((2, 3), 0), ((2, 3), 1)]
    assert isinstance(splits[0].input_dim, c.InputDim)


def _tensor_meta(cls: type) -> None:
    meta = cls(torch.Size([2, 3]), (3, 1), torch.float64)
    assert (meta.shape, meta.stride, meta.dtype) == ((2, 3), (3, 1), torch.float64)


def _runtime_schema_info(cls: type) -> None:
    info = cls(static_argnum=0, static_kwargkey=["dim"])
    assert (info.static_argnum, info.static_kwargkey) == (0, ["dim"])


def _strided_shard(cls: type) -> None:
    placement = cls(1, split_factor=2)
    assert (placement.dim, placement.split_factor) == (1, 2)


def _op_overload(cls: type) -> None:
    assert isinstance(torch.ops.aten.add.Tensor, cls)


def _op_overload_packet(cls: type) -> None:
    assert isinstance(torch.ops.aten.add, cls)


def _disabled_torch_function(impl: Callable) -> None:
    t = torch.ones(2)
    assert torch.equal(impl(torch.add, (torch.Tensor,), (t, t), {}), 2 * t)


def _kernel_query(query: Callable) -> None:
    key = _torch_compat.DispatchKey.CompositeImplicitAutograd
    assert query("aten::linear", key)
    assert not query("aten::add.Tensor", key)


def _graph_task_id(fn: Callable) -> None:
    assert fn() == -1  # outside a backward pass
    seen = []
    w = torch.ones(2, requires_grad=True)
    y = w * 2
    y.register_hook(lambda g: seen.append(fn()))
    y.sum().backward()
    assert seen and seen[0] >= 0


def _delayed_error(cls: Callable) -> None:
    """``DelayedError(message, n)`` applied to n tensors: n outputs whose backward raises it."""
    a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    out = cls(b"no second derivative here", 2)(a, b)
    assert len(out) == 2 and out[0].grad_fn is not None
    with pytest.raises(RuntimeError, match="no second derivative here"):
        out[1].sum().backward()


def _will_execute(fn: Callable) -> None:
    w = torch.ones(2, requires_grad=True)
    accumulator = (w * 1).grad_fn.next_functions[0][0]
    seen = []
    y = w * 2
    y.register_hook(lambda g: seen.append(fn(accumulator)))
    y.sum().backward()
    assert seen == [True]


def _engine(engine: object) -> None:
    done = []
    w = torch.ones(2, requires_grad=True)
    y = w * 2
    y.register_hook(lambda g: engine.queue_callback(lambda: done.append(1)))  # type: ignore[attr-defined]
    y.sum().backward()
    assert done == [1]


def _dispatch_mode(cls: type) -> None:
    seen = []

    class Recorder(cls):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recorder():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen


def _wrapper_subclass_query(fn: Callable) -> None:
    assert fn(ShardTensor)
    assert not fn(torch.Tensor)


def _tree_map(fn: Callable) -> None:
    assert fn(lambda x: x + 1, {"a": [1, (2,)]}) == {"a": [2, (3,)]}


def _propagator(propagator: object) -> None:
    _has(
        "propagate_op_sharding_non_cached",
        "op_to_schema_info",
        "op_to_schema_info_for_single_dim_strategy",
        "op_to_shape_and_stride_idx",
    )(propagator)
    _has("cache_info", "cache_clear")(propagator.propagate_op_sharding)  # type: ignore[attr-defined]


def _redistribute_module(module: object) -> None:
    _has("_planner_cache", "clear_redistribute_planner_cache", "_gen_transform_infos")(module)
    len(module._planner_cache)  # type: ignore[attr-defined]
    _has("cache_info", "cache_clear")(module._gen_transform_infos)  # type: ignore[attr-defined]


def _make_wrapper(fn: Callable) -> None:
    class Wrapper(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    w = fn(Wrapper, (2, 3), strides=(3, 1), dtype=torch.float64, device="cpu")
    assert type(w) is Wrapper and w.shape == (2, 3) and w.dtype == torch.float64


def _tree_leaves(fn: Callable) -> None:
    assert fn({"a": [1, (2,)], "b": None}) == [1, 2, None]


def _mode_on_stack(fn: Callable) -> None:
    assert fn() is False
    with _torch_compat.TorchDispatchMode():
        assert fn() is True


def _push_and_pop_mode(push: Callable) -> None:
    """``_push_mode(mode)`` puts ``mode`` on the dispatch-mode stack, ``_pop_mode()`` takes it
    off and returns it (``WorkCounter``'s NOTE [Work on local shards])."""
    mode = _torch_compat.TorchDispatchMode()
    push(mode)
    try:
        assert _torch_compat.any_torch_dispatch_mode_on_stack()
    finally:
        assert _torch_compat._pop_mode() is mode
    assert not _torch_compat.any_torch_dispatch_mode_on_stack()


def _meta_in_tls(get: Callable) -> None:
    set_ = _torch_compat._set_meta_in_tls_dispatch_include
    assert get() is False
    set_(True)
    try:
        assert get() is True
    finally:
        set_(False)


def _current_node(fn: Callable) -> None:
    assert fn() is None  # outside a backward pass
    seen = []
    w = torch.ones(2, requires_grad=True)
    y = w * 2
    y.register_hook(lambda g: seen.append(fn()))
    y.sum().backward()
    assert seen and seen[0] is not None


def _zerotensor(is_zerotensor: Callable) -> None:
    """``sgn``'s gradient is a ZeroTensor (no storage); an ordinary tensor is not."""
    x = torch.ones(3, requires_grad=True)
    assert is_zerotensor(torch.autograd.grad(x.sgn().sum(), x)[0])
    assert not is_zerotensor(torch.zeros(3))


def _decompositions(table: object) -> None:
    assert torch.ops.aten.addr.default in table  # type: ignore[operator]
    x = torch.arange(3.0)
    out = table[torch.ops.aten.addr.default](torch.zeros(3, 3), x, x)  # type: ignore[index]
    assert torch.equal(out, torch.outer(x, x))


def _no_dispatch(cm: Callable) -> None:
    seen = []

    class Recorder(_torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recorder(), cm():
        torch.ones(2) + 1
    assert seen == []


def _functorch_config(config: object) -> None:
    flag = config.disable_guess_zero_tangent_for_mutated_input_subclass  # type: ignore[attr-defined]
    assert isinstance(flag, bool)


def _trace_rules(module: object) -> None:
    _has("add", "SKIP_DIRS", "BUILTIN_INLINE_WHEN_CALLED")(module)
    assert isinstance(module.BUILTIN_INLINE_WHEN_CALLED, set)  # type: ignore[attr-defined]


def _proxy_mode(fn: Callable) -> None:
    assert fn() is None


def _disable_modes(cm: Callable) -> None:
    class Recorder(_torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise AssertionError(f"{func} reached a disabled mode")

    with Recorder(), cm():
        torch.ones(2) + 1


def _fake_process_group(cls: type) -> None:
    _has("_create_internal")(cls)


def _maybe_mark_dynamic(fn: Callable) -> None:
    t = torch.ones(3, 4)
    fn(t, 0)
    assert 0 in t._dynamo_weak_dynamic_indices  # type: ignore[attr-defined]


def _fake_mode(fn: Callable) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert fn() is None
    with FakeTensorMode() as mode:
        assert fn() is mode


def _dispatch_mode_by_key(get_mode: Callable) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = _torch_compat._TorchDispatchModeKey.FAKE
    assert get_mode(fake) is None
    with FakeTensorMode() as mode:
        assert get_mode(fake) is mode


def _is_fake(fn: Callable) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(2)
    assert fn(fake) and not fn(torch.ones(2))


def _aot_dispatch_autograd(cls: type) -> None:
    """``process_runtime_tangent(x, meta, ...)`` is a static method, read as an attribute of
    the class when a backward is compiled, and a subclass's meta names its type and holds its
    flatten context."""
    from torch._functorch._aot_autograd.schemas import SubclassCreationMeta

    assert isinstance(cls.__dict__["process_runtime_tangent"], staticmethod)
    _takes("x", "meta")(cls.process_runtime_tangent)  # type: ignore[attr-defined]
    fields = {f.name for f in dataclasses.fields(SubclassCreationMeta)}
    assert {"original_subclass_type", "meta"} <= fields, fields


def _inductor_lowerings(lowerings: dict) -> None:
    """A dict from op to lowering that holds ``with_effects``' own, which takes the token
    and the op first; inductor's graph records effect edges in ``additional_star_deps``."""
    from torch._inductor.graph import GraphLowering

    _takes("token", "op")(lowerings[torch.ops.higher_order.with_effects])
    assert "additional_star_deps" in inspect.getsource(GraphLowering.__init__)


def _autocast_on(is_on: Callable[[], bool]) -> None:
    assert is_on() is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert is_on() is True
        with torch.autocast("cpu", enabled=False):
            assert is_on() is False


def _sharding_prop(module: object) -> None:
    _takes("mesh", "op_schema", "strategy_info", "output_tensor_meta")(
        module._expand_single_dim_strategy_to_mesh  # type: ignore[attr-defined]
    )


def _prepared_single_dim_strategy(cls: type) -> None:
    _takes("self", "strategy_fn", "op_schema", "output_tensor_meta")(cls.__init__)
    source = inspect.getsource(cls.__init__)
    read = ("num_outputs", "expanded_strategies", "element_mesh", "allow_unbacked_sharding",
            "allow_uneven_sharding", "remapped_different_mesh_args")  # fmt: skip
    assert all(f"self.{name}" in source for name in read), read


def _expand_to_full_mesh(fn: Callable) -> None:
    _takes("mesh", "op_schema", "single_mesh_dim_strategies")(fn)
    keywords = {"output_tensor_meta", "input_index", "inplace_op", "allow_unbacked_sharding",
                "allow_uneven_sharding", "different_mesh_args"}  # fmt: skip
    assert keywords <= set(_parameters(fn)), _parameters(fn)


SINCE_2_13 = {
    "dtensor_sharding_prop",
    "_PreparedSingleDimStrategy",
    "expand_to_full_mesh_op_strategy",
    "TupleStrategy",
}
"""Resolved on torch 2.13 only (``_unmoved_strategy.install``)."""

SMOKE: dict[str, Callable[[object], None]] = {
    "dtensor_sharding_prop": _sharding_prop,
    "_PreparedSingleDimStrategy": _prepared_single_dim_strategy,
    "expand_to_full_mesh_op_strategy": _expand_to_full_mesh,
    "TupleStrategy": lambda cls: "children" in inspect.signature(cls).parameters,
    "DTensorSpec": _takes("mesh", "placements", "tensor_meta", "shard_order"),
    "TensorMeta": _tensor_meta,
    "OpSchema": _takes("op", "args_schema", "kwargs_schema", "schema_info"),
    "OutputSharding": _takes("output_spec", "redistribute_schema", "needs_redistribute"),
    "RuntimeSchemaInfo": _runtime_schema_info,
    "_StridedShard": _strided_shard,
    "sharding_propagator": _propagator,
    "dtensor_redistribute": _redistribute_module,
    "Flatten": _view_rules,
    "InputDim": _view_rules,
    "Split": _view_rules,
    "infer_size": _view_rules,
    "view_groups": _view_rules,
    "OpOverload": _op_overload,
    "OpOverloadPacket": _op_overload_packet,
    "_make_wrapper_subclass": _make_wrapper,
    "_disabled_torch_function_impl": _disabled_torch_function,
    "_dispatch_has_kernel_for_dispatch_key": _kernel_query,
    "DispatchKey": _has("CompositeImplicitAutograd"),
    "DelayedError": _delayed_error,
    "_is_any_autocast_enabled": _autocast_on,
    "_current_graph_task_id": _graph_task_id,
    "_will_engine_execute_node": _will_execute,
    "_execution_engine": _engine,
    "TorchDispatchMode": _dispatch_mode,
    "is_traceable_wrapper_subclass_type": _wrapper_subclass_query,
    "tree_map": _tree_map,
    "_resolve_process_group": callable,  # type: ignore[dict-item]
    "LocalTensorMode": _takes("ranks"),
    "_map_to_rank_local_val": _takes("val", "rank"),
    "dtensor_random": _has("_rng_tracker"),
    "_native_batch_norm_legit": _native_batch_norm_legit,
    "set_pg_timeout": _takes("timeout", "group"),
    "decomposition_table": _decompositions,
    "no_dispatch": _no_dispatch,
    "tree_leaves": _tree_leaves,
    "_push_mode": _push_and_pop_mode,
    "_pop_mode": callable,  # type: ignore[dict-item]
    "any_torch_dispatch_mode_on_stack": _mode_on_stack,
    "_meta_in_tls_dispatch_include": _meta_in_tls,
    "_set_meta_in_tls_dispatch_include": lambda fn: _meta_in_tls(
        _torch_compat._meta_in_tls_dispatch_include
    ),
    "_current_autograd_node": _current_node,
    "Tensor_is_zerotensor": _zerotensor,
    "Module_call_impl": lambda call: call.__code__.co_name == "_call_impl",
    "trace_rules": _trace_rules,
    "functorch_config": _functorch_config,
    "GraphLowering": lambda cls: (
        "is_inference" in inspect.signature(cls.decide_layout_opt).parameters
    ),
    "inductor_config": lambda config: config.layout_optimization is True,
    "aot_autograd_module": lambda module: callable(
        module.run_functionalized_fw_and_collect_metadata
    ),
    "aot_graph_compile": _aot_graph_compile,
    "inductor_lowerings": _inductor_lowerings,
    "inductor_virtualized": _has("graph"),
    "inductor_decomposition": lambda module: (
        torch.ops.aten.add.Tensor in module.fast_random_decomps()
        and torch.ops.aten.add.Tensor in module.decompositions
    ),
    "AOTDispatchAutograd": _aot_dispatch_autograd,
    "register_effectful_op": _takes("op", "effect"),
    "EffectType": _has("ORDERED"),
    "with_effects": lambda hop: hop.name() == "with_effects",
    "DispatchKeySet": lambda keys: keys(_torch_compat.DispatchKey.CPU).has(
        _torch_compat.DispatchKey.CPU
    ),
    "get_proxy_mode": _proxy_mode,
    "disable_current_modes": _disable_modes,
    "nn_pad": lambda pad: pad(torch.ones(1, 2), (1, 0), "constant", 0.0).tolist() == [[0.0, 1, 1]],
    "maybe_mark_dynamic": _maybe_mark_dynamic,
    "active_fake_mode": _fake_mode,
    "FakeProcessGroup": _fake_process_group,
    "_get_dispatch_mode": _dispatch_mode_by_key,
    "_TorchDispatchModeKey": _has("FAKE"),
    "is_fake": _is_fake,
}


def test_every_private_symbol_has_a_smoke_test():
    assert sorted(SMOKE) == sorted(PRIVATE_SYMBOLS)


@pytest.mark.parametrize("name", sorted(PRIVATE_SYMBOLS))
def test_private_symbol_behaves_as_shardsci_expects(name):
    if name in SINCE_2_13 and _torch_compat.torch_release() < (2, 13):
        pytest.skip("not used before torch 2.13")
    value = getattr(_torch_compat, name)
    result = SMOKE[name](value)
    assert result is None or result is True, f"{name}: smoke test returned {result!r}"


def test_a_symbol_resolves_first_in_a_new_process():
    """``AOTDispatchAutograd``'s module, imported before torch's ``aot_autograd``, is a
    circular import in torch 2.13: resolved first, it raised (its ``after`` imports that)."""
    probe = "from shardsci.tensor import _torch_compat as c; c.resolve('AOTDispatchAutograd')"
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)


@pytest.mark.parametrize("name", sorted(PRIVATE_SYMBOLS))
def test_private_symbol_is_used_by_the_library(name):
    sources = "\n".join(p.read_text() for p in LIBRARY.rglob("*.py") if p != COMPAT)
    assert name in sources, f"{name} is in PRIVATE_SYMBOLS but no library module uses it"


@pytest.mark.parametrize(
    "symbol",
    [
        PrivateSymbol("torch.distributed.tensor._no_such_module", "Spec", "a test"),
        PrivateSymbol("torch.distributed.tensor._dtensor_spec", "NoSuchSpec", "a test"),
    ],
)
def test_a_missing_symbol_fails_naming_it_and_the_torch_version(monkeypatch, symbol):
    monkeypatch.setitem(PRIVATE_SYMBOLS, "Missing", symbol)
    with pytest.raises(TorchCompatError) as raised:
        from shardsci.tensor._torch_compat import Missing  # noqa: F401
    message = str(raised.value)
    assert symbol.qualified_name in message
    assert f"torch {torch.__version__}" in message
    assert "a test" in message
    assert isinstance(raised.value, ImportError)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NotASymbol'"):
        _torch_compat.NotASymbol  # noqa: B018


def test_scalar_shape_adjusters_by_torch_version():
    """torch 2.13 rewrites native_group_norm's scalar shape arguments (its table holds it);
    2.11 and 2.12 have no table and rewrite none."""
    adjusters = _torch_compat.scalar_shape_adjusters()
    group_norm = torch.ops.aten.native_group_norm.default
    if _torch_compat.torch_release() >= (2, 13):
        assert group_norm in adjusters
        assert adjusters is _torch_compat.sharding_propagator.op_to_scalar_shape_adjuster
    else:
        assert adjusters == {}
        assert not hasattr(_torch_compat.sharding_propagator, "op_to_scalar_shape_adjuster")


def test_the_installed_torch_is_a_tested_one():
    assert ".".join(map(str, _torch_compat.torch_release())) in _torch_compat.TESTED_TORCH


def test_all_gather_single_by_torch_version():
    """torch 2.13's all_gather_single is 2.11's and 2.12's all_gather_into_tensor."""
    expected = "all_gather_single" if _torch_compat.torch_release() >= (2, 13) else None
    gather = _torch_compat.all_gather_single()
    assert gather.__name__ == (expected or "all_gather_into_tensor")


# ---------------------------------------------------------------------------- backported rules
def _backported_rules_body() -> None:
    """Plain DTensors on two ranks (DTensor's propagator holds the rules): each op's result
    placement is 2.12's and its value is one process's on the same global data."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from shardsci.testing import get_mesh

    mesh = get_mesh((2,))
    rank = torch.distributed.get_rank()
    whole = torch.arange(24, dtype=torch.float64).reshape(4, 1, 6)
    x = DTensor.from_local(whole.chunk(2)[rank], mesh, [Shard(0)])

    squeezed = x.squeeze((1,))  # aten.squeeze.dims
    assert squeezed.placements == (Shard(0),)
    assert torch.equal(squeezed.full_tensor(), whole.squeeze(1))

    flipped = x.flip(2)  # the dim it flips is not the sharded one: no communication
    assert flipped.placements == (Shard(0),)
    assert torch.equal(flipped.full_tensor(), whole.flip(2))

    anywhere = (x > 20).any(dim=(0, 2))  # aten.any.dims over the sharded dim
    assert anywhere.placements == (Partial("sum"),)
    assert torch.equal(anywhere.full_tensor(), (whole > 20).any(dim=(0, 2)))

    # amax's backward divides by a count that is a pending sum over the ranks
    counts = torch.tensor([[3.0], [5.0]], dtype=torch.float64)
    count = DTensor.from_local(counts[rank], mesh, [Partial("sum")])
    one = DTensor.from_local(torch.ones((), dtype=torch.float64), mesh, [Replicate()])
    quotient = one / count
    assert quotient.placements == (Replicate(),)
    assert torch.equal(quotient.full_tensor(), 1 / counts.sum(0))


def test_dtensor_has_the_rules_of_torch_2_12():
    """torch 2.11's DTensor lacks the rules of squeeze.dims, flip and any.dims and keeps a
    pending divisor pending; ``backport_sharding_rules`` (run when shardsci is imported)
    registers 2.12's, and on 2.12 and 2.13 it registers nothing."""
    from shardsci.testing import run_on_ranks

    run_on_ranks(2, _backported_rules_body)
    assert _torch_compat.backport_sharding_rules() == ()  # done once, at import


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(((), {}), id="older torch: (x, meta)"),
        pytest.param(
            ((0,), {"tangent_desc": None, "compile_id_str": "0/0", "tangent_stack_trace": None}),
            id="torch 2.13: (x, meta, tangent_idx, ...)",
        ),
    ],
)
def test_the_tangent_check_wrapper_passes_every_torch_signature_through(call):
    """``process_runtime_tangent`` takes ``(x, meta)`` in older torch releases (pytorch's
    runtime_wrappers as stored in the code index; which release moved is not established)
    and four optional arguments more in 2.13: shardsci's wrapper forwards whatever
    AOTAutograd passes, unchanged, and leaves a gradient alone where no ShardTensor was
    traced."""
    from shardsci.tensor._torch_compile import _plain_tangents_read_as_replicated

    seen = []

    def process(x, meta, *args, **kwargs):
        seen.append((x, meta, args, kwargs))
        return x, [x]

    args, kwargs = call
    wrapped = _plain_tangents_read_as_replicated(process, ShardTensor)
    grad, meta = torch.ones(2), dataclasses.make_dataclass("PlainMeta", ["memory_format"])(None)
    assert wrapped(grad, meta, *args, **kwargs) == (grad, [grad])
    assert seen == [(grad, meta, args, kwargs)]
