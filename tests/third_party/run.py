"""Run a third-party model on ShardTensors against one process, on the ranks of the pool.

``outcome(model, layout)`` runs one case and says what differed, aspect by aspect
(``shardsci.testing._reference.ASPECTS``); ``python -m tests.third_party.run`` runs every
case and prints the table the README and the issue cite (model x layout: values, gradients,
buffers, layout kept).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardsci import attention_exchange
from shardsci.testing import RankFailure, check_against_reference, get_mesh, run_on_ranks
from shardsci.testing._reference import ReferenceMismatch
from tests.agreement import agree, verdict_of
from tests.third_party.models import CASES, LAYOUT_NAMES, ThirdPartyCase

# Why a whole model may receive as many bytes as one gather of its input (the same reason as
# the zoo's, tests/test_zoo_sharded.py): its layers exchange features wider than the input.
LAYERS_EXCHANGE = "a model's layers exchange wider features than its input, layer after layer"
TIMEOUT_S = 300.0


def missing_package(case: ThirdPartyCase) -> str:
    """Why ``case`` cannot run here ("" when it can): its package is not installed."""
    if importlib.util.find_spec(case.package) is not None:
        return ""
    return (
        f"{case.package} is not installed: the third-party models are the optional extra "
        f"'thirdparty' of pyproject.toml, installed pinned with --no-deps by .ci/run"
    )


def _compare(case: ThirdPartyCase, layout_name: str) -> tuple[list[str], str]:
    """``(aspects that differ, the checker's report)``; ``([], "")`` when all agree."""
    mesh_shape, layout = case.field.layouts[layout_name]
    with contextlib.ExitStack() as stack:
        for shim in case.shims:
            stack.enter_context(shim.apply())
        # Attention over a split sequence takes the ring: "auto" would gather small keys and
        # values unasked (NOTE [Ring or all-gather]), which the gather guard reports.
        stack.enter_context(attention_exchange("ring"))
        torch.manual_seed(0)
        module = case.build().double()
        x = torch.randn(case.field.shape, dtype=torch.float64)
        try:
            check_against_reference(
                case.call,
                [x],
                [layout],
                get_mesh(mesh_shape),
                module=module,
                out_layouts=[case.expected(layout, case.field.shape, mesh_shape)],
                not_a_gather=LAYERS_EXCHANGE,
                what=f"{case.name} on {layout_name}",
            )
        except ReferenceMismatch as exc:
            return sorted(exc.aspects), str(exc)
    return [], ""


def _case_body(model: str, layout_name: str) -> list[tuple]:
    verdict = verdict_of(_compare, CASES[model], layout_name)
    return agree(verdict, f"{model} on {layout_name}")


@dataclass(frozen=True)
class Outcome:
    """What one case found.

    Attributes
    ----------
    kind : str
        ``equal`` (every aspect agrees with one process), ``differs`` (see ``aspects``),
        ``raised`` (the same error on every rank) or ``some-ranks`` (ranks disagree, died or
        hung).
    aspects : tuple of str
        The aspects that differ (``differs`` only).
    detail : str
        The checker's report or the error.
    seconds : float
        Wall time of the pool call.
    """

    kind: str
    aspects: tuple[str, ...]
    detail: str
    seconds: float


def outcome(model: str, layout_name: str) -> Outcome:
    """Run ``model`` on ``layout_name`` in the rank pool (see the module docstring)."""
    case = CASES[model]
    world = _world(case, layout_name)
    begun = time.perf_counter()
    try:
        # Every rank returns every rank's verdict, agreed: rank 0's list is everyone's.
        verdicts = run_on_ranks(world, _case_body, model, layout_name, timeout_s=TIMEOUT_S)[0]
    except RankFailure as failure:
        return Outcome("some-ranks", (), str(failure)[-3000:], time.perf_counter() - begun)
    seconds = time.perf_counter() - begun
    if any(v != verdicts[0] for v in verdicts):
        detail = "; ".join(f"rank {r}: {v}" for r, v in enumerate(verdicts))
        return Outcome("some-ranks", (), detail, seconds)
    verdict = verdicts[0]
    if verdict[0] == "raised":
        return Outcome("raised", (), f"{verdict[1]}: {verdict[2]}", seconds)
    aspects, report = verdict[1]
    return Outcome("differs" if aspects else "equal", tuple(aspects), report, seconds)


def _world(case: ThirdPartyCase, layout_name: str) -> int:
    mesh_shape, _ = case.field.layouts[layout_name]
    world = 1
    for n in mesh_shape:
        world *= n
    return world


def _cell(result: Outcome) -> str:
    """``values/grads/buffers; layout`` as ``=`` (equal) or ``x`` (differs), or what raised."""
    if result.kind in ("raised", "some-ranks"):
        return f"{result.kind}: {result.detail[:80]}"
    marks = [
        "=" if aspect not in result.aspects else "x"
        for aspect in ("values", "gradients", "buffers", "layout")
    ]
    return f"{marks[0]}/{marks[1]}/{marks[2]} {marks[3]}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Third-party models on ShardTensors: the table")
    parser.add_argument("--models", nargs="*", default=list(CASES))
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUT_NAMES))
    args = parser.parse_args(argv)
    from shardsci.testing import shutdown_pools

    print("| model | " + " | ".join(args.layouts) + " |")
    print("| --- |" + " --- |" * len(args.layouts))
    details = []
    try:
        for model in args.models:
            why = missing_package(CASES[model])
            cells = []
            for layout_name in args.layouts:
                if why:
                    cells.append("skipped")
                    continue
                result = outcome(model, layout_name)
                cells.append(f"{_cell(result)} ({result.seconds:.1f} s)")
                if result.kind != "equal":
                    details.append(f"{model} on {layout_name}: {result.kind}\n{result.detail}")
            print(f"| {model} | " + " | ".join(cells) + " |", flush=True)
    finally:
        shutdown_pools()
    for detail in details:
        print("\n" + detail)


if __name__ == "__main__":
    main(sys.argv[1:])
