"""PyTorch's OpInfo database on ShardTensors: every sample, sharded, against one process.

Each case is one OpInfo sample (float64, CPU) run twice on every rank: on plain tensors (the
reference) and with its first tensor argument sharded as a layout says, the other tensor
arguments replicated (passed as plain tensors). A case is

- ``correct``: outputs (values, dtypes, shapes, each shard the size its spec says) and the
  gradient of the sharded input match the reference;
- ``error``: every rank raised the same type of error, with a message that names the op;
- ``wrong``: it ran everywhere and some output or gradient differs (silently wrong);
- ``unclear``: every rank raised, but the message does not say which op failed;
- ``some-ranks``: only some ranks raised, they raised different errors, or a rank died or
  hung (found by a deadline on a separate process group, see NOTE [Agreeing on a case's
  outcome]);
- ``skipped``: not applicable to the layout (no dim large enough to shard) or the reference
  itself raised.

Ops that may raise (clear) errors are listed, with the reason, in ``op_db_unsupported.py``;
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
import math
import re
import sys
import tempfile
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from shardsci.testing import Layout, RankFailure, get_mesh, run_on_ranks

OUTCOMES = ("correct", "error", "wrong", "unclear", "some-ranks", "skipped")
_ATOL = 1e-7
_RTOL = 1e-7
_AGREEMENT_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------------- layouts
def _two_uneven(extent: int) -> tuple[int, int]:
    """Two non-empty shards of different sizes that are not ``torch.chunk``'s, where
    possible: 5 -> (2, 3), 4 -> (1, 3), 2 -> (1, 1)."""
    first = extent // 2 if extent % 2 else max(extent // 2 - 1, 1)
    return first, extent - first


def _four_with_empty_first(extent: int) -> tuple[int, int, int, int]:
    """Rank 0 empty, the rest split unevenly: 5 -> (0, 3, 1, 1), 2 -> (0, 2, 0, 0)."""
    third = extent // 3
    return 0, extent - 2 * third, third, third


@dataclass(frozen=True)
class SweepLayout:
    """How a sample's first tensor argument is sharded.

    Attributes
    ----------
    name : str
        Shown in reports.
    mesh : tuple of int
        Mesh shape; the world size is its product.
    """

    name: str
    mesh: tuple[int, ...]

    @property
    def world(self) -> int:
        return math.prod(self.mesh)

    def layout_for(self, shape: Sequence[int]) -> Layout | None:
        """The layout of a tensor of ``shape``, or None when it has no dims to shard so."""
        if self.name == "2r-uneven":
            dim = next((d for d, n in enumerate(shape) if n >= 2), None)
            return None if dim is None else Layout((Shard(dim),), {dim: _two_uneven(shape[dim])})
        if self.name == "4r-empty":
            dims = [d for d, n in enumerate(shape) if n >= 3] or [
                d for d, n in enumerate(shape) if n >= 1
            ]
            if not dims:
                return None
            dim = dims[-1]
            return Layout((Shard(dim),), {dim: _four_with_empty_first(shape[dim])})
        dims = [d for d, n in enumerate(shape) if n >= 2][:2]
        if len(dims) < 2:
            return None
        sizes = {d: _two_uneven(shape[d]) for d in dims}
        return Layout((Shard(dims[0]), Shard(dims[1])), sizes)


#: 2 ranks, the first dim of extent >= 2 split unevenly (not ``torch.chunk`` sizes); 4 ranks,
#: the last dim of extent >= 3 split with rank 0 empty; a 2x2 mesh, the first two dims of
#: extent >= 2 each split unevenly.
LAYOUTS = {
    layout.name: layout
    for layout in (
        SweepLayout("2r-uneven", (2,)),
        SweepLayout("4r-empty", (4,)),
        SweepLayout("2x2-uneven", (2, 2)),
    )
}


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


@functools.lru_cache(maxsize=8)
def _samples(key: str, scan: int | None) -> tuple:
    """The first ``scan`` samples of an op (all with None), generated identically on every
    rank (seeded by the op's key)."""
    op = database()[key]
    torch.manual_seed(sum(key.encode()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = op.sample_inputs("cpu", torch.float64, requires_grad=op.supports_autograd)
        return tuple(itertools.islice(samples, scan))


def selected_samples(key: str, layout: SweepLayout, limit: int | None) -> list[tuple]:
    """``(index, sample, layout of its first tensor or None)`` for the samples of op ``key``
    to run on ``layout``: every sample (``limit`` None), else the first ``limit`` whose first
    tensor can be sharded that way, among the first ``4 * limit + 4`` (the first 64 when those
    hold none: some ops' first samples are all scalars or empty)."""
    if limit is None:
        return [(i, s, _layout_of(s, layout)) for i, s in enumerate(_samples(key, None))]
    for scan in (4 * limit + 4, 64):
        chosen = []
        for index, sample in enumerate(_samples(key, scan)):
            sharded = _layout_of(sample, layout)
            if sharded is not None:
                chosen.append((index, sample, sharded))
            if len(chosen) == limit:
                return chosen
        if chosen:
            return chosen
    return []


def _layout_of(sample, layout: SweepLayout) -> Layout | None:
    """None also for a sparse first tensor: ShardTensors shard strided tensors only."""
    first, _ = _first_tensor(sample)
    if first is None or first.layout != torch.strided:
        return None
    return layout.layout_for(first.shape)


@dataclass(frozen=True)
class Expectations:
    """What ``op_db_unsupported.py`` says: ops that may raise a clear error (with why), and
    ops whose output values are random or uninitialised (only shapes are compared), always or
    in some samples."""

    unsupported: dict[str, str]
    unchecked_values: dict[str, str]
    random_when: dict[str, Callable[[object], bool]]

    @classmethod
    def load(cls) -> Expectations:
        from tests import op_db_unsupported

        return cls(
            op_db_unsupported.UNSUPPORTED,
            op_db_unsupported.VALUES_NOT_COMPARED,
            op_db_unsupported.RANDOM_WHEN,
        )

    def compares_values(self, key: str, sample) -> bool:
        if key in self.unchecked_values:
            return False
        return not (key in self.random_when and self.random_when[key](sample))


# ---------------------------------------------------------------------------- one case
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


def _copied(value: object) -> object:
    """Fresh, gradient-free copies of the tensors in ``value`` (sharded runs and the reference
    must not share storage or autograd history)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _differentiable(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def _call(op, sample, rebuild: Callable, x: torch.Tensor) -> object:
    """Run the op with ``x`` in place of the first tensor argument, fresh copies of the
    others."""
    inputs, args = rebuild(x)
    if isinstance(inputs, (list, tuple)):
        inputs = type(inputs)([inputs[0], *(_copied(v) for v in inputs[1:])])
    return op(inputs, *_copied(args), **_copied(sample.kwargs))


def _flat_outputs(out: object) -> list:
    if isinstance(out, (list, tuple)):
        return [leaf for item in out for leaf in _flat_outputs(item)]
    return [out]


def run_case(op, sample, layout: Layout, mesh, compare_values: bool) -> str | None:
    """Run one case on this rank; return what differs from the reference (None: nothing).

    Raises whatever the sharded run raises.
    """
    from shardsci.tensor._api import from_local_spec, grad_spec

    first, rebuild = _first_tensor(sample)
    grad = op.supports_autograd and _differentiable(first)
    reference_leaf = first.detach().clone().requires_grad_(grad)
    try:
        expected = _call(op, sample, rebuild, reference_leaf)
    except Exception:
        return "skip: the reference raised"
    spec = layout.spec(mesh, first)
    local_leaf = spec.narrow(first.detach()).clone().requires_grad_(grad)
    actual = _call(op, sample, rebuild, from_local_spec(local_leaf, spec))

    expected_flat, actual_flat = _flat_outputs(expected), _flat_outputs(actual)
    if len(expected_flat) != len(actual_flat):
        return f"{len(actual_flat)} outputs, reference has {len(expected_flat)}"
    for i, (a, e) in enumerate(zip(actual_flat, expected_flat)):
        problem = _compare_output(a, e, compare_values)
        if problem:
            return f"output {i}: {problem}"
    if not grad or not compare_values:
        return None
    process = sample.output_process_fn_grad
    expected_terms = _differentiable_outputs(_flat_outputs(process(expected)))
    actual_terms = _differentiable_outputs(_flat_outputs(process(actual)))
    if not expected_terms:
        return None
    generator = torch.Generator().manual_seed(7)
    projections = [torch.randn(e.shape, dtype=e.dtype, generator=generator) for e in expected_terms]
    try:
        _loss(expected_terms, projections).backward()
    except Exception:
        return None
    sharded_projections = [
        _laid_out_like(p, a, from_local_spec, grad_spec) for p, a in zip(projections, actual_terms)
    ]
    _loss(actual_terms, sharded_projections).backward()
    expected_grad = reference_leaf.grad
    expected_grad = spec.narrow(torch.zeros_like(first) if expected_grad is None else expected_grad)
    actual_grad = torch.zeros_like(local_leaf) if local_leaf.grad is None else local_leaf.grad
    problem = _mismatch(actual_grad, expected_grad)
    return f"input gradient: {problem}" if problem else None


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


def _laid_out_like(projection, out, from_local_spec, grad_spec):
    from shardsci.tensor import ShardTensor

    if not isinstance(out, ShardTensor):
        return projection
    spec = grad_spec(out._spec).with_dtype(projection.dtype)
    return from_local_spec(spec.narrow(projection), spec)


def _compare_output(actual: object, expected: object, compare_values: bool) -> str | None:
    from shardsci.tensor import ShardTensor

    if not isinstance(expected, torch.Tensor):
        if isinstance(actual, torch.Tensor):
            return f"a tensor where the reference returned {expected!r}"
        return None if actual == expected or actual is expected else f"{actual!r} != {expected!r}"
    if not isinstance(actual, torch.Tensor):
        return f"{actual!r} where the reference returned a tensor"
    if isinstance(actual, ShardTensor):
        local, claimed = tuple(actual._local.shape), tuple(actual._spec.local_shape())
        if local != claimed:
            return f"shard of shape {local} where its spec says {claimed} ({actual._spec})"
        with torch.no_grad():
            actual = actual.full_tensor()
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return (
            f"shape {tuple(actual.shape)} {actual.dtype}, reference "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    return _mismatch(actual, expected) if compare_values else None


def _mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    try:
        torch.testing.assert_close(
            actual.detach(), expected.detach(), atol=_ATOL, rtol=_RTOL, equal_nan=True
        )
    except AssertionError as exc:
        return " ".join(str(exc).split())[:300]
    return None


# ---------------------------------------------------------------------------- on the ranks
# NOTE [Agreeing on a case's outcome]
# After each case every rank reports what it saw (ran, with or without a mismatch; raised;
# skipped) in an all-gather on a process group of its own, with a deadline. A case that
# raised on some ranks only leaves the others waiting in one of the op's collectives, on
# the mesh's groups: they never reach the agreement, which times out on the ranks that did,
# and those end the pool call naming the case. Because the agreement never shares a group
# with the op's collectives, a rank stuck there cannot be fed the agreement's messages. Rank
# 0 logs each case before running it and its outcome after, to a file the parent reads, so a
# case during which a rank died or hung is known even though the pool call returns nothing.
_agreement: dict[int, object] = {}


def _agreement_group():
    world = dist.get_world_size()
    if world not in _agreement:
        _agreement[world] = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=_AGREEMENT_TIMEOUT_S)
        )
    return _agreement[world]


def _cases(
    layout: SweepLayout,
    chunk: tuple[int, int],
    limit: int | None,
    pattern: str | None,
    resume_after: tuple[str, int] | None,
) -> Iterator[tuple[str, int, object, Layout | None]]:
    """``(op key, sample index, sample, layout)`` of every case of this chunk of the database
    (ops whose key matches ``pattern``) after ``resume_after``, in order."""
    keys = sorted(k for k in database() if pattern is None or re.search(pattern, k))
    for key in keys[chunk[0] :: chunk[1]]:
        if resume_after is not None and key < resume_after[0]:
            continue
        for index, sample, sharded in selected_samples(key, layout, limit):
            if resume_after is None or (key, index) > resume_after:
                yield key, index, sample, sharded


def _local_verdict(key: str, sample, sharded: Layout | None, mesh, compare_values: bool):
    """This rank's view of one case: ``("ran", mismatch or None)``, ``("raised", type,
    message)`` or ``("skip", why)``."""
    if sharded is None:
        return ("skip", "no tensor dim to shard in this layout")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problem = run_case(database()[key], sample, sharded, mesh, compare_values)
    except Exception as exc:
        message = " ".join(str(exc).split())
        return ("raised", type(exc).__name__, message[:500])
    if problem and problem.startswith("skip: "):
        return ("skip", problem[len("skip: ") :])
    return ("ran", problem)


def _agree(verdict: tuple, group, where: str) -> list[tuple]:
    """Every rank's verdict. One all-gather of a fingerprint when all ran cleanly; the
    verdicts themselves only when they differ or report something."""
    code = 0 if verdict == ("ran", None) else 1 + zlib.crc32(repr(verdict).encode())
    world = dist.get_world_size(group)
    fingerprints = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    try:
        dist.all_gather(fingerprints, torch.tensor([code]), group=group)
        if all(f.item() == 0 for f in fingerprints):
            return [verdict] * world
        verdicts: list = [None] * world
        dist.all_gather_object(verdicts, verdict, group=group)
    except RuntimeError as exc:
        raise RuntimeError(
            f"{where}: not every rank reached the agreement within "
            f"{_AGREEMENT_TIMEOUT_S:.0f} s; this rank saw {verdict}"
        ) from exc
    return verdicts


def sweep_body(
    layout_name: str,
    chunk: tuple[int, int],
    limit: int | None,
    resume_after: tuple[str, int] | None,
    log_path: str,
    pattern: str | None,
) -> None:
    """Run the cases of a chunk of the database after ``resume_after`` on this rank (see
    the NOTE above)."""
    layout = LAYOUTS[layout_name]
    mesh = get_mesh(layout.mesh)
    expectations = Expectations.load()
    group = _agreement_group()
    rank = dist.get_rank()
    with open(log_path, "a") as log:
        for key, index, sample, sharded in _cases(layout, chunk, limit, pattern, resume_after):
            case = {"op": key, "sample": index}
            if rank == 0:
                log.write(json.dumps({"begin": True, **case}) + "\n")
                log.flush()
            begun = time.perf_counter()
            compare = expectations.compares_values(key, sample)
            verdict = _local_verdict(key, sample, sharded, mesh, compare)
            seconds = time.perf_counter() - begun
            verdicts = _agree(verdict, group, f"{key} sample {index}")
            if rank == 0:
                outcome, detail = classify(database()[key].name, verdicts)
                record = {**case, "outcome": outcome, "detail": detail}
                log.write(json.dumps({**record, "seconds": round(seconds, 4)}) + "\n")
                log.flush()


def classify(name: str, verdicts: list[tuple]) -> tuple[str, str]:
    """One case's outcome from every rank's verdict (see the module docstring)."""
    kinds = {v[0] for v in verdicts}
    if kinds == {"skip"}:
        return "skipped", verdicts[0][1]
    if kinds == {"ran"}:
        problems = [(r, v[1]) for r, v in enumerate(verdicts) if v[1]]
        if not problems:
            return "correct", ""
        return "wrong", "; ".join(f"rank {r}: {p}" for r, p in problems)
    if kinds == {"raised"} and len({v[1] for v in verdicts}) == 1:
        message = f"{verdicts[0][1]}: {verdicts[0][2]}"
        return ("error" if names_op(name, verdicts[0][2]) else "unclear"), message
    return "some-ranks", "; ".join(f"rank {r}: {v[1:]}" for r, v in enumerate(verdicts))


def names_op(name: str, message: str) -> bool:
    """Whether an error message says which op failed: an op overload (``aten.cumprod.default``,
    ``mylib::op``) or the OpInfo's function name (``hardtanh`` for
    ``nn.functional.hardtanh``)."""
    if re.search(r"\baten\.\w+|\b\w+\.\w+\.default\b|\w+::\w+", message):
        return True
    return name.split(".")[-1] in message


# ---------------------------------------------------------------------------- in the parent
def sweep(
    layout: SweepLayout,
    chunk: tuple[int, int] = (0, 1),
    limit: int | None = None,
    pattern: str | None = None,
) -> list[dict]:
    """Every case of a chunk of the database on ``layout``: one record per case with its
    ``op``, ``sample``, ``outcome``, ``detail`` and ``seconds`` (on rank 0)."""
    with tempfile.TemporaryDirectory(prefix="shardsci-op-db-") as tmp:
        log_path = Path(tmp) / "cases.jsonl"
        log_path.touch()
        resume_after = None
        while True:
            try:
                run_on_ranks(
                    layout.world,
                    sweep_body,
                    layout.name,
                    chunk,
                    limit,
                    resume_after,
                    str(log_path),
                    pattern,
                    timeout_s=3600.0,
                )
                break
            except RankFailure as failure:
                resume_after = _record_failure(log_path, failure)
        return [r for r in _read(log_path) if "outcome" in r]


def _read(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in log_path.read_text().splitlines() if line]


def _record_failure(log_path: Path, failure: RankFailure) -> tuple[str, int]:
    """Log the case a failed pool call was running as ``some-ranks``; return it."""
    records = _read(log_path)
    if not records or "begin" not in records[-1]:
        raise failure
    case = {"op": records[-1]["op"], "sample": records[-1]["sample"]}
    lines = [
        line
        for line in str(failure).splitlines()
        if line.strip() and not line.startswith((" ", "Traceback"))
    ]
    detail = "a rank died or hung: " + " | ".join(lines)[:1500]
    with open(log_path, "a") as log:
        record = {**case, "outcome": "some-ranks", "detail": detail, "seconds": None}
        log.write(json.dumps(record) + "\n")
    return case["op"], case["sample"]


def counts(records: list[dict]) -> dict[str, int]:
    """Cases per outcome, plus ``cases``: those not skipped."""
    tally = Counter(r["outcome"] for r in records)
    result = {"cases": sum(n for o, n in tally.items() if o != "skipped")}
    result.update({o: tally.get(o, 0) for o in OUTCOMES})
    return result


def problems(records: list[dict], expectations: Expectations) -> list[str]:
    """Every case the sweep must not accept: wrong, unclear, some-ranks, and errors of ops
    that are not listed as unsupported."""
    found = []
    for r in records:
        where = f"{r['op']} sample {r['sample']}: {r['outcome']}: {r['detail']}"
        if r["outcome"] in ("wrong", "unclear", "some-ranks"):
            found.append(where)
        elif r["outcome"] == "error" and r["op"] not in expectations.unsupported:
            found.append(f"{where} (not listed in op_db_unsupported.py)")
    return found


def stale(records: list[dict], expectations: Expectations) -> list[str]:
    """Ops listed as unsupported that raised no error in any case of ``records``."""
    ran = {r["op"] for r in records}
    failed = {r["op"] for r in records if r["outcome"] == "error"}
    return sorted(op for op in expectations.unsupported if op in ran and op not in failed)


def write_summary(path: Path, records: list[dict], samples: int | None, pattern: str | None):
    """``path.json`` and ``path.md``: the counts per layout of ``records`` and how they were
    produced."""
    layouts = {}
    for name in LAYOUTS:
        mine = [r for r in records if r["layout"] == name]
        if mine:
            tally = counts(mine)
            correct = tally["correct"] / tally["cases"] if tally["cases"] else 1.0
            layouts[name] = {**tally, "correct_fraction": round(correct, 4)}
    command = (
        "OMP_NUM_THREADS=1 python -m tests.op_db_sweep"
        + (f" --samples {samples}" if samples is not None else "")
        + (f" --ops '{pattern}'" if pattern else "")
        + f" --summary {path}"
    )
    summary = {
        "command": command,
        "torch": torch.__version__,
        "ops": len({r["op"] for r in records}),
        "samples_per_op": samples or "all",
        "layouts": layouts,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = [
        f"| {name} | {t['cases']} | {t['correct']} ({100 * t['correct_fraction']:.1f} %) | "
        f"{t['error']} | {t['wrong']} | {t['some-ranks']} | {t['unclear']} | {t['skipped']} |"
        for name, t in layouts.items()
    ]
    path.with_suffix(".md").write_text(
        "# PyTorch's OpInfo database on ShardTensors\n\n"
        f"{summary['ops']} OpInfo entries (float64, CPU), the first "
        f"{summary['samples_per_op']} samples of each, torch {torch.__version__}; the first "
        "tensor argument sharded (2r-uneven: 2 ranks, uneven; 4r-empty: 4 ranks, rank 0 "
        "empty; 2x2-uneven: two dims over a 2x2 mesh), compared with one process, forward and "
        "the sharded input's gradient (see `tests/op_db_sweep.py`). *error*: the same clear "
        "error on every rank, for ops listed with a reason in `tests/op_db_unsupported.py`.\n\n"
        "| layout | cases | correct | error | wrong | some ranks | unclear | skipped |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        + f"\n\nRegenerate: `{command}`\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=[*LAYOUTS, "all"], default="all")
    parser.add_argument("--samples", type=int, default=None, help="samples per op (default all)")
    parser.add_argument("--ops", default=None, help="regex on op keys (default all)")
    parser.add_argument("--records", type=Path, default=None, help="write every case here")
    parser.add_argument(
        "--summary", type=Path, default=None, help="write the counts to PATH.json and PATH.md"
    )
    args = parser.parse_args(argv)
    expectations = Expectations.load()
    layouts = LAYOUTS.values() if args.layout == "all" else [LAYOUTS[args.layout]]
    everything = []
    try:
        for layout in layouts:
            records = sweep(layout, (0, 1), args.samples, args.ops)
            for r in records:
                r["layout"] = layout.name
            everything.extend(records)
            print(json.dumps({"layout": layout.name, **counts(records)}), flush=True)
            for line in problems(records, expectations):
                print("  " + line, flush=True)
    finally:
        from shardsci.testing import shutdown_pools

        shutdown_pools()
    if args.records:
        args.records.write_text("".join(json.dumps(r) + "\n" for r in everything))
    if args.summary:
        write_summary(args.summary, everything, args.samples, args.ops)


if __name__ == "__main__":
    main(sys.argv[1:])
