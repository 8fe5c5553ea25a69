"""PyTorch's OpInfo database on uneven and empty shards, against one process.

Every case must give the reference's result (values, shard sizes, the layout its cells'
dependencies state, and the gradient of every differentiable tensor argument) or raise the
same clear error on every rank, an error ``op_db_unsupported.py`` accepts for that op, sample
and message; the cases of known shardsci bugs are listed there too, by op, sample, layout and
message, and fail the sweep once they no longer show the bug (see ``tests/op_db_sweep.py``).

- Always on (``test_op_db``): the first sample of every op, each op on one of the five
  layouts in turn.
- ``-m slow``: every op's first sample on every layout
  (``pytest -m slow tests/test_op_db.py -k first_sample``, about five times the fast sweep),
  every sample of every op on every layout (``-k every_sample``), and the check that every
  entry of the lists still matches a case (``-k still_matches``). The same sweeps, with counts
  per layout: ``python -m tests.op_db_sweep --samples 1`` (see its ``--help``).

The sweep itself is checked here too: an op implemented as "gather everything, compute, lay
the result out again" fails it by its layout, and a listed gather the gather guard does not
see fails it as ``wrong``; a handler that drops a plain argument's
gradient fails it; an error the list does not accept for that sample or message, or raised
on some ranks only, fails it; random values and a reference whose backward raises are
counted as not checked, never as correct.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.opinfo.core import SampleInput

from shardsci.testing import get_mesh, run_on_ranks
from tests.agreement import agree
from tests.op_db_sweep import (
    LAYOUTS,
    Expectations,
    by_world,
    classify,
    counts,
    database,
    other_tensors,
    problems,
    run_case,
    selected_samples,
    stale,
    sweep,
    verdict_of_case,
)
from tests.op_db_unsupported import Accepted

RANKS_IMPORT = ("torch.testing._internal.common_methods_invocations",)
"""The database (``database()``), about 3.4 s of CPU an import: once for every rank (see
``tests/conftest.py``). The pytest process has already imported what it changes (the
backends' flags frozen, warning filters) with ``opinfo.core`` above."""

FAST_SAMPLES = 1
FULL_CHUNKS = 12


def _check(world: int, chunk: int, chunks: int, limit: int | None, dealt: bool = False) -> None:
    """The sweep's cases on the layouts of ``world`` ranks: none wrong, unclear or on some
    ranks only, every error listed for its sample, and every entry that applies matched."""
    records = sweep(by_world()[world], (chunk, chunks), limit, dealt=dealt)
    expectations = Expectations.load()
    found = problems(records, expectations)
    found += [f"{entry}: matched no case it applies to" for entry in stale(records, expectations)]
    summary = {r["layout"]: counts([x for x in records if x["layout"] == r["layout"]])
               for r in records}  # fmt: skip
    assert not found, f"{summary}: {len(found)} problems:\n" + "\n".join(found[:40])


@pytest.mark.parametrize("world", by_world())
def test_op_db(world: int) -> None:
    """Every op's first sample, on one of the five layouts in turn (the suite's budget)."""
    _check(world, 0, 1, FAST_SAMPLES, dealt=True)


@pytest.mark.slow
@pytest.mark.parametrize("world", by_world())
def test_op_db_first_sample_every_layout(world: int) -> None:
    _check(world, 0, 1, FAST_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(FULL_CHUNKS))
@pytest.mark.parametrize("world", by_world())
def test_op_db_every_sample(world: int, chunk: int) -> None:
    _check(world, chunk, FULL_CHUNKS, None)


@pytest.mark.slow
def test_every_entry_of_the_lists_still_matches() -> None:
    """The lists stay honest: each entry of ``op_db_unsupported.UNSUPPORTED`` and
    ``KNOWN_BUGS`` applies to some case and still matches a case it applies to, and every
    case an entry applies to is accepted by one (an op may raise on one layout only, as
    adaptive pooling does where its windows straddle shards). Only those cases run: the
    samples each entry names on the layouts it names (every sample for an entry of any
    sample); the other cases of these ops are the every-sample sweep's (``-k every_sample``)."""
    expectations = Expectations.load()
    listed = expectations.listed_cases()
    records = [r for layouts in by_world().values() for r in sweep(layouts, listed=listed)]
    found = problems(records, expectations)
    found += [f"{entry}: matched no case" for entry in stale(records, expectations)]
    found += [
        f"{op}: {entry}: applies to no case"
        for op in listed
        for entry in expectations.entries(op)
        if not any(r["op"] == op and entry.applies(r) for r in records)
    ]
    assert not found, "\n".join(found)


def test_expectations_name_real_ops() -> None:
    expectations = Expectations.load()
    known = database()
    listed = [
        *expectations.unsupported,
        *expectations.known_bugs,
        *expectations.unchecked_values,
        *expectations.random_when,
    ]
    assert not [k for k in listed if k not in known], "unknown OpInfo names in the list"


# ---------------------------------------------------------------------------- the sweep fails
def _gathering_sin(how: str):
    """``torch.sin`` the lazy way: gather, compute on the whole tensor, lay the result out
    again: as a plain tensor, replicated, or re-split with ``torch.chunk`` sizes."""
    from shardsci.handlers import ShardTensorSpec, from_local_spec
    from shardsci.tensor._spec import replicated_spec

    def handler(func, args, kwargs):
        x = args[0]
        whole = torch.sin(x.full_tensor())
        if how == "plain":
            return whole
        mesh = x.spec.mesh
        if how == "replicated":
            spec = replicated_spec(whole, mesh)
        else:
            spec = ShardTensorSpec.build(mesh, x.spec.placements, whole.shape, whole.dtype)
        return from_local_spec(spec.narrow(whole), spec)

    return handler


def _gathering_fallback_body(how: str) -> tuple[str, str]:
    from shardsci.handlers import register_function_handler, scoped_handlers

    layout = LAYOUTS["2r-uneven"]
    mesh = get_mesh(layout.mesh)
    _, sample, sharded = selected_samples("sin", layout, 1)[0]
    with scoped_handlers():
        register_function_handler(torch.sin, replace=True)(_gathering_sin(how))
        verdict, _ = verdict_of_case("sin", sample, sharded, mesh, None)
    outcome, detail = classify("sin", agree(verdict, f"sin gathered ({how})"))
    return outcome, detail


@pytest.mark.parametrize(
    ("how", "expected"), [("plain", "wrong"), ("replicated", "gathered"), ("chunk", "wrong")]
)
def test_a_gathering_fallback_fails_the_sweep(how: str, expected: str) -> None:
    """Registered for one op, a fallback that gathers fails the sweep by its layout (the
    values are right): ``gathered`` where it replicates through the guard (its
    ``full_tensor()`` inside an op), ``wrong`` where the layout is wrong otherwise; either
    way a case no entry lists. A fallback that re-splits exactly as it should is not visible
    to the sweep; ``check_against_reference``'s traffic check catches it
    (``tests/test_reference_checker.py``)."""
    outcome, detail = run_on_ranks(2, _gathering_fallback_body, how)[0]
    assert outcome == expected, (outcome, detail)
    assert ": layout: " in detail, detail
    record = {"op": "sin", "sample": 0, "layout": "2r-uneven", "outcome": outcome}
    assert problems([{**record, "detail": detail}], Expectations.load())


def _gather_unguarded_body(key: str, sample: int, layout: str) -> list[tuple[str, str]]:
    """The case classified as the sweep does it, then again with the guard's check of
    redistributions made a no-op (a gather past the guard)."""
    from shardsci.tensor import _redistribute

    mesh = get_mesh(LAYOUTS[layout].mesh)
    ((_, case, sharded),) = selected_samples(key, LAYOUTS[layout], None, (sample,))
    outcomes = []
    for unguarded in (False, True):
        check = _redistribute.check_redistribution
        if unguarded:
            _redistribute.check_redistribution = lambda src, dst: None
        try:
            verdict, _ = verdict_of_case(key, case, sharded, mesh, None)
        finally:
            _redistribute.check_redistribution = check
        outcomes.append(classify(database()[key].name, agree(verdict, f"{key} {unguarded}")))
    return outcomes


def test_a_gather_the_guard_misses_fails_the_sweep() -> None:
    """A listed gathered case (``argsort`` along the sharded dim: no distributed sort) is
    ``gathered`` and accepted while the guard sees its gather; with the guard's check
    bypassed, the same case is ``wrong`` (``the gather guard saw no gather``) and no entry
    accepts it."""
    key, sample, layout = "argsort", 1, "2r-uneven"
    said, silent = run_on_ranks(2, _gather_unguarded_body, key, sample, layout)[0]
    expectations = Expectations.load()
    record = {"op": key, "sample": sample, "layout": layout}
    assert said[0] == "gathered", said
    assert problems([{**record, "outcome": said[0], "detail": said[1]}], expectations) == []
    assert silent[0] == "wrong", silent
    assert silent[1].endswith(" | the gather guard saw no gather"), silent
    assert problems([{**record, "outcome": silent[0], "detail": silent[1]}], expectations)


def _mul_dropping_the_other_gradient(func, args, kwargs):
    """``torch.mul`` whose plain second operand gets no gradient (detached, then the
    ordinary path)."""
    x, y = args
    if isinstance(y, torch.Tensor) and y.requires_grad:
        return torch.mul(x, y.detach(), **kwargs)
    return NotImplemented


def _other_gradient_dropped_body() -> tuple[str, str]:
    from shardsci.handlers import register_function_handler, scoped_handlers

    layout = LAYOUTS["2r-uneven"]
    mesh = get_mesh(layout.mesh)
    index, sample, sharded = selected_samples("mul", layout, 1)[0]
    assert [t.requires_grad for t in other_tensors(sample)] == [True], index
    with scoped_handlers():
        register_function_handler(torch.mul, replace=True)(_mul_dropping_the_other_gradient)
        verdict, _ = verdict_of_case("mul", sample, sharded, mesh, None)
    return classify("mul", agree(verdict, "mul without the other gradient"))


def test_a_wrong_gradient_of_a_plain_argument_fails_the_sweep() -> None:
    """The gradient of every differentiable tensor argument is checked, not only the sharded
    one's: a handler that drops the plain operand's gradient makes the case wrong."""
    outcome, detail = run_on_ranks(2, _other_gradient_dropped_body)[0]
    assert outcome == "wrong", (outcome, detail)
    assert "gradient of tensor argument 1" in detail, detail
    assert "gradient of the sharded input" not in detail, detail


class _RaisingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise RuntimeError("no backward here")


class _FakeOp:
    """The parts of an OpInfo that ``run_case`` reads: ``x * 2`` on plain tensors, with a
    backward that raises (the reference's); ShardTensors take the ordinary product."""

    supports_autograd = True
    name, variant_test_name = "fake", ""

    def __call__(self, x):
        from shardsci.tensor import ShardTensor

        return x * 2 if isinstance(x, ShardTensor) else _RaisingBackward.apply(x)


def _reference_backward_raises_body() -> tuple:
    layout = LAYOUTS["2r-uneven"]
    x = torch.randn(5, 3, dtype=torch.float64)
    result = run_case(
        _FakeOp(), SampleInput(x), layout.layout_for(x.shape), get_mesh(layout.mesh), None
    )
    return result.problem, result.unchecked


def test_a_reference_whose_backward_raises_is_not_checked() -> None:
    problem, unchecked = run_on_ranks(2, _reference_backward_raises_body)[0]
    assert problem is None
    assert unchecked == "gradients: the reference's backward raised RuntimeError"


def test_a_case_with_something_unchecked_is_not_counted_correct() -> None:
    """Random values (dropout) or a reference whose backward raised: ``not-checked`` on the
    ranks' agreement, never ``ok``; a problem on one rank makes the case wrong."""
    unchecked = ("ran", None, "values random in this sample", None)
    assert classify("dropout", [unchecked, unchecked]) == (
        "not-checked",
        "values random in this sample",
    )
    assert classify("sin", [("ran", None, None, None)] * 2) == ("ok", "")
    wrong = ("ran", "output 0: layout: x", None, None)
    outcome, detail = classify("sin", [("ran", None, None, None), wrong])
    assert (outcome, detail) == ("wrong", "rank 1: output 0: layout: x")


def _record(outcome: str, detail: str, sample: int = 3, layout: str = "4r-empty") -> dict:
    return {"op": "op", "sample": sample, "layout": layout, "outcome": outcome, "detail": detail}


def test_the_lists_accept_only_their_samples_layouts_and_messages() -> None:
    entry = Accepted(r"ValueError: .*windows of different", "why", samples=(3, 4))
    expectations = Expectations({"op": (entry,)}, {}, {})
    accepted = _record("error", "ValueError: op: windows of different lengths")
    assert problems([accepted], expectations) == []
    for record in (
        _record("error", "ValueError: op: windows of different lengths", sample=5),
        _record("error", "RuntimeError: op: something else"),
        _record("some-ranks", "rank 0: ('raised', 'ValueError', 'windows of different')"),
    ):
        assert len(problems([record], expectations)) == 1, record
    assert stale([accepted], expectations) == []
    other = _record("error", "RuntimeError: op: something else")
    assert stale([other], expectations) == [f"op: {entry}"]


def test_the_summary_counts_layouts_apart_from_values_and_gives_reasons(tmp_path) -> None:
    """``docs/op_db_sweep.md``'s figures: a wrong layout the gather guard commented on is no
    wrong value; a rerun's record replaces the first run's; each case short of ok is
    listed with the reason of the entry that accepts it, or as not listed."""
    import json

    from tests.op_db_sweep import read_records, short_of_ok, wrong_values

    layout = "rank 0: output 0: layout: mesh axis 0 is R; expected Shard(0) (depends: 1x1)"
    assert not wrong_values(_record("wrong", f"{layout} | the gather guard saw no gather"))
    assert wrong_values(_record("wrong", f"{layout} | output 1: Tensor-likes are not close!"))
    first, rerun = tmp_path / "first.jsonl", tmp_path / "rerun.jsonl"
    first.write_text(json.dumps(_record("wrong", layout)) + "\n")
    rerun.write_text(json.dumps(_record("ok", "")) + "\n")
    assert [r["outcome"] for r in read_records([first, rerun])] == ["ok"]
    entry = Accepted(r"ValueError: ", "why not", samples=(3,))
    expectations = Expectations({"op": (entry,)}, {}, {})
    rows = short_of_ok(
        [_record("error", "ValueError: op"), _record("wrong", layout, sample=4)], expectations
    )
    assert [(r["outcome"], r["samples"], r["reason"][:11]) for r in rows] == [
        ("error", {"4r-empty": [3]}, "why not"),
        ("wrong", {"4r-empty": [4]}, "not listed:"),
    ]


def test_the_summary_gives_a_family_of_inherent_gathers_one_row(tmp_path) -> None:
    """``GATHERED_FAMILIES``: the gathered cases of a family's ops, listed or not, make one
    row with the family's reason and the number of cases per layout; the family's other
    outcomes and other ops keep their own rows; the Markdown names the family and its ops."""
    from tests.op_db_sweep import short_of_ok, write_summary

    layout = "rank 0: output 0: layout: mesh axis 0 is R; expected Shard(0) (depends: 1x1)"
    records = [
        {**_record("gathered", layout, sample=0), "op": "qr"},
        {**_record("gathered", layout, sample=1, layout="2x2-last"), "op": "svd"},
        {**_record("gathered", layout, sample=2, layout="2x2-last"), "op": "svd"},
        {**_record("error", "ValueError: svd"), "op": "svd"},
        _record("gathered", layout),
    ]
    family = {"split matrices": ("no distributed factorisation", frozenset({"qr", "svd"}))}
    expectations = Expectations({}, {}, {}, {}, family)
    rows = short_of_ok(records, expectations)
    assert [(r["op"], r["outcome"], r["samples"], r["reason"][:11]) for r in rows] == [
        ("svd", "error", {"4r-empty": [3]}, "not listed:"),
        ("op", "gathered", {"4r-empty": [3]}, "not listed:"),
        ("split matrices", "gathered", {"4r-empty": 1, "2x2-last": 2}, "no distribu"),
    ]
    assert rows[2]["ops"] == ["qr", "svd"]
    load = Expectations.load
    Expectations.load = classmethod(lambda cls: expectations)
    try:
        write_summary(tmp_path / "summary", records, 3, None)
    finally:
        Expectations.load = load
    text = (tmp_path / "summary.md").read_text()
    assert (
        "| *split matrices* (2 ops: `qr`, `svd`) | gathered | 4r-empty: 1 case; 2x2-last: 2 cases |"
        in text
    )


def test_a_known_bug_is_accepted_until_it_is_fixed() -> None:
    """Like a strict xfail: a known bug's entry accepts its cases, and fails the sweep once
    none of the cases it applies to shows the bug."""
    bug = Accepted(r": layout: mesh axis 0 is R;", "gathers", outcome="wrong")
    expectations = Expectations({}, {}, {}, {"op": (bug,)})
    wrong = _record("wrong", "rank 0: output 0: layout: mesh axis 0 is R; expected Shard(0)")
    assert problems([wrong], expectations) == []
    assert stale([wrong], expectations) == []
    assert stale([_record("ok", "")], expectations) == [f"op: {bug}"]


@pytest.mark.parametrize("pool", ["max_pool1d", "min by -max_pool1d(-x)"])
def test_the_dependency_probe_sees_a_window_maximum_reach_both_shards(pool: str) -> None:
    """NOTE [An output cell belongs to the shard it depends on]: a window that straddles two
    shards depends on both, whichever holds its maximum, on the op database's data (uniform
    in [-9, 9], where a move by an element's own magnitude left a larger maximum in the other
    block unmoved and the window was taken for that block's alone; 40 of 50 draws misjudged)."""
    from tests.expected_layouts import Dependence, cell_owners

    def call(x: torch.Tensor) -> list[torch.Tensor]:
        if pool == "max_pool1d":
            return [torch.nn.functional.max_pool1d(x, 3, 1)]
        return [-torch.nn.functional.max_pool1d(-x, 3, 1)]

    generator = torch.Generator().manual_seed(0)
    for draw in range(20):
        x = torch.rand(1, 2, 10, dtype=torch.float64, generator=generator) * 18 - 9
        # Outputs 3 and 4 read inputs 3..5 and 4..6: both shards of the split (5, 5).
        expected = [Dependence({2: (0, 0, 0, None, None, 1, 1, 1)})]
        assert cell_owners(call, x, 2, (5, 5)) == expected, draw


def test_a_cell_unmoved_by_a_block_holding_nan_is_not_owned() -> None:
    """NOTE [An output cell belongs to the shard it depends on]: the probe cannot move a NaN,
    so ``nansum`` of the row ``[nan, 2]`` did not change with the NaN's block and seemed owned
    by the other's (the op database's nansum sample 32 on 2x2-uneven and 2x2-last expected the
    row sums split on the columns' axis, where a pending sum is right)."""
    from tests.expected_layouts import Dependence, cell_owners

    def call(a: torch.Tensor) -> list[torch.Tensor]:
        return [a.nansum(-1)]

    x = torch.tensor([[float("nan"), 2.0], [0.0, 1.0]], dtype=torch.float64)
    assert cell_owners(call, x, 1, (1, 1)) == [Dependence({}, combined=True)]
    # split by rows, the sums still follow their rows where the probe can tell
    assert cell_owners(call, x, 0, (1, 1)) == [Dependence({0: (0, None)})]
    assert cell_owners(call, x.nan_to_num(), 0, (1, 1)) == [Dependence({0: (0, 1)})]


def _nansum_nan_sample_body(layout: str) -> tuple[str, str]:
    mesh = get_mesh(LAYOUTS[layout].mesh)
    ((_, case, sharded),) = selected_samples("nansum", LAYOUTS[layout], None, (32,))
    verdict, _ = verdict_of_case("nansum", case, sharded, mesh, None)
    return classify("nansum", agree(verdict, f"nansum 32 {layout}"))


@pytest.mark.parametrize("layout", ["2x2-uneven", "2x2-last", "2r-uneven", "4r-empty"])
def test_nansum_of_rows_holding_nan_matches_one_process(layout: str) -> None:
    """The op database's nansum sample 32, ``[[nan, 2], [0, 1]].nansum(-1)``, against one
    process (values, float64 gradient and layout, as the sweep checks them): a pending sum
    over the split columns, the rows kept where they are split."""
    outcome = run_on_ranks(LAYOUTS[layout].world, _nansum_nan_sample_body, layout)[0]
    assert outcome[0] == "ok", outcome


def _rules(call, x: torch.Tensor, layout) -> list:
    from tests.expected_layouts import axis_rules, cell_owners

    (dim,) = layout.sizes
    owners = cell_owners(call, x, dim, layout.sizes[dim])
    return axis_rules({0: owners[0]}, layout, x.shape, call(x)[0].shape, (2,))


def test_a_masked_scan_along_the_sharded_dim_keeps_the_input_sizes() -> None:
    """NOTE [An output cell belongs to the shard it depends on]: a masked cumulative sum along
    the split dim reads, for a cell whose own row is masked out, only earlier rows, so every
    index along the *other* dim has one owner and that dim seemed to carry the split (the
    op database's masked.cumsum/cumprod sample 1 expected Shard(1) of the rows' Shard(0));
    a transpose still moves the split to the other dim."""
    from tests.expected_layouts import AxisRule, parse

    layout = parse("S0; 0=2/3")
    x = torch.randn(5, 5, dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 1, 1, 0], [1, 0, 1, 1, 0], [0, 1, 0, 0, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]],
        dtype=torch.bool,
    )
    masked = _rules(lambda a: [torch.masked.cumsum(a, 0, mask=mask)], x, layout)
    assert masked == [AxisRule(0, 0, (0, 0, 1, 1, 1), "same-shape", reads_elsewhere=True)]
    transposed = _rules(lambda a: [a.t().contiguous()], x, layout)
    assert transposed == [AxisRule(0, 1, (0, 0, 1, 1, 1), "depends")]


def test_a_contraction_over_the_sharded_dim_may_be_partial() -> None:
    """The op database's matmul sample 14, ``(5, 5, 5) @ (1, 5, 5)`` with the contracted dim
    split: every output cell reads every shard, so no cell has an owner; the output's shape is
    the input's by chance, and partial sums (which move nothing) are as good as the input's
    sizes (it expected Shard(2) of the output's columns)."""
    from torch.distributed.tensor import Partial, Shard

    from tests.expected_layouts import AxisRule, held_where, parse

    layout = parse("S2; 2=3/2")
    x = torch.randn(5, 5, 5, dtype=torch.float64)
    w = torch.randn(1, 5, 5, dtype=torch.float64)
    rules = _rules(lambda a: [a @ w], x, layout)
    assert rules == [AxisRule(0, 2, (0, 0, 0, 1, 1), "same-shape or partial", reads_elsewhere=True)]
    assert held_where(rules, [Partial()], {}, {}, x.shape, (2,)) == ""
    assert held_where(rules, [Shard(2)], {2: (3, 2)}, {}, x.shape, (2,)) == ""
    # a cell that reads one shard keeps the rule strict: softmax along an unsplit dim
    strict = _rules(lambda a: [a.softmax(1)], x, layout)
    assert held_where(strict, [Partial()], {}, {}, x.shape, (2,)) != ""


@pytest.mark.parametrize("k", [1, -1, 2])
def test_a_rotation_moves_the_split_with_its_sizes(k: int) -> None:
    """NOTE [An output cell belongs to the shard it depends on]: ``rot90`` of a square split
    by rows into (2, 3) is split by columns (k = 1, -1) or rows (k = 2) with the rows' sizes.
    Its columns (k = -1) or rows (k = 2) depend on the row blocks in reverse, so no dim seemed
    to carry the split, and the square shape kept it on dim 0, a dim no rank splits after the
    transpose (the op database's rot90 samples 1, 13 and 25 expected Shard(0))."""
    from torch.distributed.tensor import Shard

    from tests.expected_layouts import held_where, parse

    layout = parse("S0; 0=2/3")
    x = torch.randn(5, 5, dtype=torch.float64)
    rules = _rules(lambda a: [torch.rot90(a, k)], x, layout)
    dim = 0 if k == 2 else 1
    assert [(r.dim, r.owners) for r in rules] == [(dim, (0, 0, 1, 1, 1))]
    assert held_where(rules, [Shard(dim)], {dim: (2, 3)}, {}, x.shape, (2,)) == ""
    assert held_where(rules, [Shard(1 - dim)], {1 - dim: (2, 3)}, {}, x.shape, (2,)) != ""
    assert held_where(rules, [Shard(dim)], {dim: (3, 2)}, {}, x.shape, (2,)) != ""
    flipped = _rules(lambda a: [a.flip(0)], x, layout)
    assert [(r.dim, r.owners) for r in flipped] == [(0, (0, 0, 1, 1, 1))]


def test_an_empty_output_states_no_layout() -> None:
    """The op database's linalg.multi_dot sample 2, ``(0, 2) @ (2, 2)`` with the contracted
    dim split: the output has the input's shape and no cell, so any layout holds nothing
    (it expected Shard(1) with the input's sizes of a pending sum)."""
    from tests.expected_layouts import parse

    layout = parse("S1; 1=1/1")
    w = torch.randn(2, 2, dtype=torch.float64)
    assert _rules(lambda a: [a @ w], torch.randn(0, 2, dtype=torch.float64), layout) == []
    assert _rules(lambda a: [a @ w], torch.randn(1, 2, dtype=torch.float64), layout) != []


def test_a_split_held_by_one_rank_may_move_to_any_dim_it_holds() -> None:
    """The op database's rot90 samples 8 and 20 on 4r-random: a 5x5x5 tensor whose dim 2 one
    rank holds whole (sizes 0/0/0/5). Every output cell depends on that rank alone, so every
    output dim carries the split with one owner; rot90 moving it to dim 1, all of it on that
    rank, moves nothing, as Shard(2) would (it expected Shard(2))."""
    from torch.distributed.tensor import Shard

    from tests.expected_layouts import axis_rules, cell_owners, held_where, parse

    layout = parse("S2; 2=0/0/0/5")
    x = torch.randn(5, 5, 5, dtype=torch.float64)
    (dim,) = layout.sizes
    owners = cell_owners(lambda a: [torch.rot90(a, 1, (1, 2))], x, dim, layout.sizes[dim])
    rules = axis_rules({0: owners[0]}, layout, x.shape, x.shape, (4,))
    for held in (1, 2):
        assert held_where(rules, [Shard(held)], {held: (0, 0, 0, 5)}, {}, x.shape, (4,)) == ""
    assert held_where(rules, [Shard(1)], {1: (0, 0, 1, 4)}, {}, x.shape, (4,)) != ""


def test_a_transform_along_the_split_dim_may_move_it() -> None:
    """NOTE [A layout an op documents over its dependencies]: the op database's fft.fftn and
    fft.ifftn sample 1, over every dim of a (5, 6, 7) tensor split along dim 0 into (2, 3).
    Every spectrum cell reads both shards, so the same-shape rule asked for Shard(0) or a
    pending sum; the library leaves the spectrum on dim 2 (NOTE [Where a distributed FFT
    leaves the spectrum]), which the fft ops' rule takes, and no other op's."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from tests.expected_layouts import AxisRule, documented, held_where, parse

    layout = parse("S0; 0=2/3")
    x = torch.randn(5, 6, 7, dtype=torch.float64)
    stated = _rules(lambda a: [torch.fft.fftn(a, norm="ortho")], x, layout)
    assert [(r.dim, r.rule) for r in stated] == [(0, "same-shape or partial")]
    rules = documented("fft.fftn", stated, layout, x.ndim)
    assert [r.text for r in rules] == ["same-shape or partial or moved"]
    for placement, sizes in ((Shard(2), {2: (4, 3)}), (Shard(0), {0: (2, 3)}), (Partial(), {})):
        assert held_where(rules, [placement], sizes, {}, x.shape, (2,)) == ""
    assert held_where(rules, [Replicate()], {}, {}, x.shape, (2,)) != ""
    assert held_where(rules, [Shard(0)], {0: (3, 2)}, {}, x.shape, (2,)) != ""
    # fft2 of a 2-D block: the last transformed dim split over both axes, nested
    block = parse("S0,S2; 0=2/3; 2=4/3")
    on_both = [r for r in documented("fft.fftn", stated, layout, x.ndim)] + [
        AxisRule(1, 2, (0,) * 4 + (1,) * 3, "same-shape or partial", "moved", True)
    ]
    nested = {0: (2, 3), 2: (2, 2, 2, 1)}
    assert held_where(on_both, [Shard(2), Shard(2)], nested, {}, x.shape, (2, 2)) == ""
    assert held_where(on_both, block.placements, {2: (3, 4), 0: (2, 3)}, {}, x.shape, (2, 2)) != ""
    assert held_where(stated, [Shard(2)], {2: (4, 3)}, {}, x.shape, (2,)) != ""
    other = documented("linalg.matrix_exp", stated, layout, x.ndim)
    assert held_where(other, [Shard(2)], {2: (4, 3)}, {}, x.shape, (2,)) != ""
    # a transform along an unsplit dim keeps the strict rule
    along_w = documented("fft.fft", _rules(lambda a: [torch.fft.fft(a)], x, layout), layout, 3)
    assert [r.text for r in along_w] == ["same-shape"]
    assert held_where(along_w, [Shard(2)], {2: (4, 3)}, {}, x.shape, (2,)) != ""


def test_a_lookup_in_a_table_split_by_rows_may_be_a_pending_sum() -> None:
    """NOTE [A layout an op documents over its dependencies]: the op database's
    nn.functional.embedding sample 0, index 7 in a (10, 5) table split by rows into (4, 6).
    The looked-up row lies in the second shard, so the output's 5 cells depend on it alone
    and the rule asked for Shard(0), all on that rank: which rank holds it, the index's value
    decides. The library returns a pending sum over the vocabulary axes (NOTE [A split table
    is looked up where it lies]), which the embedding's rule takes; a table split by columns
    keeps the strict rule."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Partial, Replicate, Shard

    from tests.expected_layouts import documented, held_where, parse

    index = torch.tensor(7)
    table = torch.randn(10, 5, dtype=torch.float64)
    layout = parse("S0; 0=4/6")
    stated = _rules(lambda w: [F.embedding(index, w)], table, layout)
    assert [(r.dim, r.owners, r.rule) for r in stated] == [(0, (1,) * 5, "depends")]
    rules = documented("nn.functional.embedding", stated, layout, table.ndim)
    assert held_where(rules, [Partial()], {}, {}, (5,), (2,)) == ""
    assert held_where(rules, [Shard(0)], {0: (0, 5)}, {}, (5,), (2,)) == ""
    for wrong in (Replicate(), Partial("avg")):
        assert held_where(rules, [wrong], {}, {}, (5,), (2,)) != ""
    assert held_where(stated, [Partial()], {}, {}, (5,), (2,)) != ""
    by_columns = parse("S1; 1=2/3")
    looked_up = _rules(lambda w: [F.embedding(index, w)], table, by_columns)
    kept = documented("nn.functional.embedding", looked_up, by_columns, table.ndim)
    assert [r.text for r in kept] == ["depends"]
    assert held_where(kept, [Partial()], {}, {}, (5,), (2,)) != ""


def test_a_transform_reading_some_shards_may_move_it() -> None:
    """NOTE [A layout an op documents over its dependencies]: the op database's fft.irfft and
    fft.hfft sample 2 on 2x2-last, ``irfft(x, n=7)`` along a dim of 7 split into (4, 3). It
    reads only the first 4 modes, all in the first shard, so every output cell depends on
    that shard alone: the rule was the input's sizes, strictly, where the library moves the
    split onto another dim as for any transform along a split dim."""
    from torch.distributed.tensor import Partial, Shard

    from tests.expected_layouts import documented, held_where, parse

    layout = parse("S1; 1=4/3")
    x = torch.randn(3, 7, dtype=torch.complex128)
    stated = _rules(lambda a: [torch.fft.irfft(a, n=7)], x, layout)
    assert [(r.dim, r.rule, r.reads_elsewhere) for r in stated] == [(1, "same-shape", True)]
    rules = documented("fft.irfft", stated, layout, x.ndim)
    assert [r.text for r in rules] == ["same-shape or moved"]
    for placement, sizes in ((Shard(0), {0: (2, 1)}), (Shard(1), {1: (4, 3)})):
        assert held_where(rules, [placement], sizes, {}, (3, 7), (2,)) == ""
    assert held_where(rules, [Partial()], {}, {}, (3, 7), (2,)) != ""
    assert held_where(stated, [Shard(0)], {0: (2, 1)}, {}, (3, 7), (2,)) != ""
    # A cell that reads its own shard only keeps the strict rule, for an fft too.
    along_rows = _rules(lambda a: [torch.fft.fft(a, dim=0)], x, layout)
    assert [r.reads_elsewhere for r in along_rows] == [False]
    kept = documented("fft.fft", along_rows, layout, x.ndim)
    assert held_where(kept, [Shard(0)], {0: (2, 1)}, {}, (3, 7), (2,)) != ""


def test_a_cell_two_shards_windows_cover_may_be_held_by_either() -> None:
    """NOTE [A layout an op documents over its dependencies]: max_unpool1d of a pooled (1, 1,
    4) split (2, 2), kernel 3 stride 2 (the op database's max_unpool samples): windows [2, 5)
    of the first shard and [4, 7) of the second both cover cell 4. Its index points at 4 from
    the first shard's window, so the probe owns it to the first rank; the library gives it to
    the rank of the last window starting at or before it, the second. Which window's maximum
    it is, the indices decide: the rule takes either rank there, and only there; windows that
    tile (kernel 2) keep the strict rule."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    from tests.expected_layouts import documented, held_where, parse, window_covers

    assert window_covers((2, 2), 9, 3, 2, 0) == [{0}] * 4 + [{0, 1}] + [{1}] * 4
    indices = torch.tensor([[[1, 4, 5, 7]]])
    x = torch.randn(1, 1, 4, dtype=torch.float64)
    layout = parse("S2; 2=2/2")
    windows = {"kernel_size": 3, "stride": 2, "padding": 0, "output_size": (9,)}
    stated = _rules(lambda v: [F.max_unpool1d(v, indices, **windows)], x, layout)
    assert [(r.dim, r.owners[3:6]) for r in stated] == [(2, (None, 0, 1))]  # 3: no index
    op = "nn.functional.max_unpool1d"
    rules = documented(op, stated, layout, x.ndim, x.shape, (2,), windows)
    assert [(r.owners[3:6], r.text) for r in rules] == [
        ((None, None, 1), "depends or either window")
    ]

    def held(rules, sizes):
        return held_where(rules, [Shard(2)], {2: sizes}, {}, (1, 1, 9), (2,))

    assert held(stated, (4, 5)) != ""  # the library's layout, before the rule
    assert held(rules, (4, 5)) == "" and held(rules, (5, 4)) == ""
    assert held(rules, (1, 8)) != "" and held(rules, (6, 3)) != ""  # cells 1, 5: one shard's
    tiles = {"kernel_size": 2, "stride": 2, "padding": 0, "output_size": (8,)}
    tiled = _rules(lambda v: [F.max_unpool1d(v, indices, **tiles)], x, layout)
    kept = documented(op, tiled, layout, x.ndim, x.shape, (2,), tiles)
    assert [r.text for r in kept] == ["depends"]


def test_a_loss_over_split_classes_may_be_a_pending_sum() -> None:
    """NOTE [A layout an op documents over its dependencies]: the op database's
    nn.functional.nll_loss samples 0-5 (reduction 'none') with the class dim split. Each
    loss term depends on the shard holding its target's class, which the targets decide: with
    targets (0, 2) of classes split (1, 2), the rule asked for Shard(0) with the terms on
    ranks 0 and 1. The library returns a pending sum over the class axes (NOTE [A loss over
    split classes is a pending sum]), which the rule now takes; a split of the batch keeps the
    strict rule."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Partial, Replicate, Shard

    from tests.expected_layouts import PENDING_SUMS, documented, held_where, parse

    target = torch.tensor([0, 2])
    x = torch.randn(2, 3, dtype=torch.float64).log_softmax(1)
    by_classes = parse("S1; 1=1/2")
    stated = _rules(lambda a: [F.nll_loss(a, target, reduction="none")], x, by_classes)
    assert [(r.dim, r.owners, r.rule) for r in stated] == [(0, (0, 1), "depends")]
    rules = documented("nn.functional.nll_loss", stated, by_classes, x.ndim)
    assert held_where(rules, [Partial()], {}, {}, (2,), (2,)) == ""
    assert held_where(rules, [Shard(0)], {0: (1, 1)}, {}, (2,), (2,)) == ""
    for wrong in (Replicate(), Partial("avg")):
        assert held_where(rules, [wrong], {}, {}, (2,), (2,)) != ""
    assert held_where(stated, [Partial()], {}, {}, (2,), (2,)) != ""
    by_batch = parse("S0; 0=1/1")
    looked_up = _rules(lambda a: [F.nll_loss(a, target, reduction="none")], x, by_batch)
    kept = documented("nn.functional.nll_loss", looked_up, by_batch, x.ndim)
    assert held_where(kept, [Partial()], {}, {}, (2,), (2,)) != ""
    assert PENDING_SUMS["nn.functional.nll_loss"].dims(1) == (0,)  # a (C,) input: its classes


def test_a_histogram_of_split_data_may_be_a_pending_sum() -> None:
    """The op database's histc sample 18 on 4r-empty and 4r-random: the elements of the
    blocks fall in different bins, so each bin depends on one block and the rule asked for
    Shard(0) of the bins; which block's elements a bin counts is the data's values. The
    library returns each rank's counts as a pending sum (NOTE [A histogram is a pending sum of
    each rank's counts]), along any split dim."""
    from torch.distributed.tensor import Partial, Replicate

    from tests.expected_layouts import documented, held_where, parse

    rows = torch.tensor([[0.0, 1.0, 2.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
    signal = torch.tensor([0.0, 1.0, 8.0, 9.0], dtype=torch.float64)
    for x, layout in ((rows, parse("S0; 0=1/1")), (signal, parse("S0; 0=2/2"))):
        stated = _rules(lambda a: [torch.histc(a, bins=3)], x, layout)
        assert [r.rule for r in stated] == ["depends"], layout
        rules = documented("histc", stated, layout, x.ndim)
        assert held_where(rules, [Partial()], {}, {}, (3,), (2,)) == ""
        assert held_where(rules, [Replicate()], {}, {}, (3,), (2,)) != ""
        assert held_where(stated, [Partial()], {}, {}, (3,), (2,)) != ""


def test_a_histogram_density_is_a_pending_sum_and_its_edges_are_computed_alike() -> None:
    """The op database's histogram sample 34 (one bin, ``density=True``) on 4r-random, every
    element on one block: the density and the edges (from the data's range) depend on that
    block alone. The library returns the density as a pending sum (each rank's counts over
    the global total) and the edges replicated, every rank computing them alike from the
    all-reduced range (NOTE [A histogram is a pending sum of each rank's counts]); the rule
    takes each for its own output only."""
    from torch.distributed.tensor import Partial, Replicate

    from tests.expected_layouts import axis_rules, cell_owners, documented, held_where, parse

    x = torch.tensor([0.0, 1.0, 8.0, 9.0, 4.0], dtype=torch.float64)
    layout = parse("S0; 0=0/5")

    def call(a: torch.Tensor) -> list:
        return list(torch.histogram(a, bins=1, density=True))

    owners = cell_owners(call, x, 0, (0, 5))
    for k, held, refused in ((0, Partial(), Replicate()), (1, Replicate(), Partial())):
        shape = tuple(call(x)[k].shape)
        stated = axis_rules({0: owners[k]}, layout, x.shape, shape, (2,))
        assert [(r.rule, r.owners) for r in stated] == [("depends", (1,) * shape[0])], k
        rules = documented("histogram", stated, layout, x.ndim, output=k)
        assert held_where(rules, [held], {}, {}, shape, (2,)) == "", k
        assert held_where(rules, [refused], {}, {}, shape, (2,)) != "", k
        assert held_where(stated, [held], {}, {}, shape, (2,)) != "", k


def test_every_pending_sum_is_stated_by_a_note_of_the_library() -> None:
    """The ops whose outputs the sweep takes as a pending sum are real OpInfo keys, and the
    NOTE each names is written in the library (a line of its own, not a mention)."""
    import re
    from pathlib import Path

    import shardsci
    from tests.expected_layouts import PENDING_SUMS

    source = "\n".join(p.read_text() for p in Path(shardsci.__file__).parent.rglob("*.py"))
    assert [op for op in PENDING_SUMS if op not in database()] == []
    unwritten = [
        e.note
        for e in PENDING_SUMS.values()
        if not re.search(rf"^(# )?NOTE \[{re.escape(e.note)}\]$", source, re.MULTILINE)
    ]
    assert unwritten == []
