"""Training on rollouts (``train.rollout``, NOTE [Unrolled training]): the k-step loss against
its definition written out by hand, and on a 2x2x2 block of ShardTensors (the 3-D recipe's
default decomposition, uneven, with empty blocks) against one process, float64, values and
the gradients of the model's parameters and of the fields; a mistyped gradient mode is refused
when the config is composed (the range checks are in ``tests/test_run_checks.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Partial

import shardsci.train  # noqa: F401 (registers the run's and the recipes' config schemas)
from shardsci.models import FNO
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from shardsci.training import RolloutGradient, unrolled_loss

ROOT = Path(__file__).resolve().parents[1]
BLOCK = Layout((Shard(2), Shard(3), Shard(4)), {2: (5, 3), 3: (2, 4), 4: (6, 0)})
"""(B, 3, 8, 6, 6) fields on mesh 2x2x2: uneven along D and H, the second W block empty."""
PENDING_SUM = Layout((Partial(),) * 3)
"""The loss, as the one-step loss (``mse_loss`` of ShardTensors): a scalar whose sum over the
ranks is pending, all-reduced once when the trainer takes it whole."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return FNO(
        in_channels=3, out_channels=3, modes=(2, 2, 2), width=4, layers=1,
        projection_channels=4, residual=True,
    ).double()  # fmt: skip


def _fields(k: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 8, 6, 6, dtype=torch.float64, generator=generator) for _ in range(k)]


@pytest.mark.parametrize("gradient", list(RolloutGradient))
def test_the_unrolled_loss_is_the_mean_of_the_steps_or_the_pushforward_step(
    gradient: RolloutGradient,
) -> None:
    """Against the definition: ``all``, the mean of the k one-step losses with the gradient
    through every step; ``last``, the last step's loss from a detached (k - 1)-step state."""
    start, *truths = _fields(4)
    model, reference = _model(), _model()
    loss = unrolled_loss(model, start, truths, F.mse_loss, gradient)
    loss.backward()
    states, state = [], start
    for step in range(len(truths)):
        state = reference(state)
        if gradient is RolloutGradient.last and step < len(truths) - 1:
            state = state.detach()
        states.append(state)
    expected = (
        sum(F.mse_loss(s, t) for s, t in zip(states, truths)) / len(truths)
        if gradient is RolloutGradient.all
        else F.mse_loss(states[-1], truths[-1])
    )
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)
    one_step = unrolled_loss(model, start, truths[:1], F.mse_loss, gradient)
    torch.testing.assert_close(one_step, F.mse_loss(model(start), truths[0]), rtol=0, atol=0)


def _block_body(gradient: str, steps: int) -> None:
    def loss(module: torch.nn.Module, start: torch.Tensor, *truths: torch.Tensor) -> torch.Tensor:
        return unrolled_loss(module, start, truths, F.mse_loss, RolloutGradient(gradient))

    check_against_reference(
        loss,
        _fields(steps + 1),
        [BLOCK] * (steps + 1),
        get_mesh((2, 2, 2)),
        module=_model(),
        out_layouts=[PENDING_SUM],
        not_a_gather="the FNO's spectra, unrolled over several steps",
        what=f"{steps}-step {gradient} loss",
    )


@pytest.mark.slow  # about a minute here at load 10-20 (8 ranks, 3-D FFTs); -m slow
@pytest.mark.parametrize("gradient", [g.value for g in RolloutGradient])
def test_the_unrolled_loss_on_a_2x2x2_block_equals_one_process(gradient: str) -> None:
    """The 3-step loss of the recipe's model on the recipe's decomposition: the loss, every
    parameter's gradient and the fields' gradients equal one process in float64."""
    run_on_ranks(8, _block_body, gradient, 3)


def test_a_mistyped_gradient_mode_is_refused_when_the_config_is_composed(
    tmp_path: Path,
) -> None:
    overrides = ["+recipe=cfd", f"run_dir={tmp_path}", "train.rollout.gradient=first"]
    with (
        initialize_config_dir(str(ROOT / "configs"), version_base="1.3"),
        pytest.raises(
            ConfigCompositionException, match=r"train\.rollout\.gradient=first"
        ) as refused,
    ):
        compose("config", overrides=overrides)
    assert "Invalid value 'first', expected one of [all, last]" in str(refused.value.__cause__)
