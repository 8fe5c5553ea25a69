"""Autograd Functions whose backward is not differentiable: second derivatives through them
raise (NOTE [Second derivatives through ShardTensors] in ``_api.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from shardsci.tensor._torch_compat import DelayedError

__all__ = ["first_order_only"]


def first_order_only(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate an autograd Function's backward that is not itself differentiable: run it
    without building a graph and, where the running backward builds one and the results
    depend on a tensor that requires grad (an incoming gradient, or one the forward saved
    with ``save_for_backward``), return results that raise when differentiated, naming
    ``what``. Unlike ``once_differentiable``, the saved tensors count too (NOTE [Second
    derivatives through ShardTensors])."""

    def decorate(backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def run(ctx: Any, *grads: Any) -> Any:
            with torch.no_grad():
                results = backward(ctx, *grads)
            if not torch.is_grad_enabled():
                return results
            sources = [
                t
                for t in (*grads, *ctx.saved_tensors)
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if not sources:
                return results
            many = isinstance(results, tuple)
            results = results if many else (results,)
            given = [r for r in results if isinstance(r, torch.Tensor)]
            # One node whose backward raises, between the results and what they depend on.
            error = DelayedError(
                f"shardsci: second derivatives through {what} are not supported (its "
                f"backward is not differentiable)".encode(),
                len(given) + len(sources),
            )
            marked = iter(error(*(_marked(r) for r in given), *sources)[: len(given)])
            out = tuple(next(marked) if isinstance(r, torch.Tensor) else r for r in results)
            return out if many else out[0]

        return run

    return decorate


def _marked(result: torch.Tensor) -> torch.Tensor:
    result = result.detach()
    result.requires_grad_()
    return result
