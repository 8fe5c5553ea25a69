"""Can a model of this recipe learn the one-step map of a velocity file? A one-process probe.

Trains one of the recipe's models (``configs/recipe/cfd3d/model/<name>.yaml``) on plain tensors
in one process, with the recipe's loss (mean squared error of fields normalised per channel by
the training trajectories' statistics) and AdamW with the trainer's schedule (warm-up, then
cosine decay over ``--steps``: ``train.schedule``), then prints the one-step relative L2 error
on the training pairs and on the held-out pairs beside persistence's. A training error well below a held-out error that stays at persistence's is
overfitting, whatever the step count; that is what the recipe's default data showed (README,
"The 3-D recipe").

Usage
-----
``python -m shardsci.recipes.cfd3d.learnability data/generated/ns3d_32.h5 --steps 100``
(``--model unet``, ``--set modes=[4,4,4]``: the model's settings; ``--augment``: each batch
mapped by a random symmetry of the box, as the recipe's ``data.augment``; ``--stride 2``: pairs
two records apart; ``--n-train``: the first trajectories train, the rest are held out;
``--eval-every 50``: the held-out error every 50 steps as well; ``--rollout-steps 3
--rollout-gradient last``: trained on 3-step rollouts, as ``train.rollout``, NOTE [Unrolled
training]; ``--rollout 10``: each held-out figure also gives the mean relative L2 after 10
steps of the recipe's evaluation rollout, from the middle snapshot of each held-out
trajectory or the latest start that leaves 10 steps).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import h5py
import torch
import torch.nn.functional as F
from hydra.utils import get_class
from omegaconf import OmegaConf

import shardsci.configs
from shardsci.recipes.cfd3d.generate import DATASET_NAME
from shardsci.recipes.cfd3d.symmetry import box_symmetries
from shardsci.recipes.models import ZOO
from shardsci.training import (
    RolloutGradient,
    ScheduleConfig,
    relative_l2,
    rollout,
    unrolled_loss,
    warmup_cosine,
)


def recipe_model(name: str, overrides: list[str] | None = None) -> torch.nn.Module:
    """The recipe's model ``name`` with its 3-D settings, as ``model=<name>`` builds it, and
    ``overrides`` (``["modes=[4,4,4]", "width=8"]``) as ``model.<key>=<value>`` would."""
    config_type, target = ZOO[name]
    settings = Path(shardsci.configs.__file__).parent / f"recipe/cfd3d/model/{name}.yaml"
    merged = OmegaConf.merge(OmegaConf.load(settings), OmegaConf.from_dotlist(overrides or []))
    fields = OmegaConf.to_container(merged)
    tuples = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return get_class(target)(config_type(**tuples))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a velocity file (trajectory, time, 3, D, H, W)")
    parser.add_argument("--model", default="fno", choices=("fno", "unet", "transolver"))
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="model settings, e.g. width=8"
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--n-train", type=int, default=4)
    parser.add_argument("--stride", type=int, default=1, help="records between input and target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-every", type=int, default=0, help="print the held-out error every N steps too"
    )
    parser.add_argument(
        "--augment", action="store_true", help="map each batch by a random symmetry of the box"
    )
    parser.add_argument("--rollout-steps", type=int, default=1, help="train.rollout.steps")
    parser.add_argument(
        "--rollout-gradient", default="all", choices=[g.value for g in RolloutGradient]
    )
    parser.add_argument(
        "--rollout", type=int, default=0, help="also the held-out error after this many steps"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    with h5py.File(args.path, "r") as file:
        velocity = torch.from_numpy(file[DATASET_NAME][:]).float()
    train, held_out = velocity[: args.n_train], velocity[args.n_train :]
    if len(held_out) == 0:
        parser.error(f"--n-train={args.n_train} leaves no held-out trajectory")
    per_channel = (0, 1, 3, 4, 5)
    mean = train.mean(dim=per_channel).view(1, 3, 1, 1, 1)
    std = train.std(dim=per_channel).view(1, 3, 1, 1, 1)

    def samples(fields: torch.Tensor, unrolled: int) -> list[torch.Tensor]:
        """Normalised fields at t, t + s, ..., t + unrolled * s, every t that leaves them."""
        s, last = args.stride, fields.shape[1] - unrolled * args.stride
        return [
            ((fields[:, k * s : last + k * s] - mean) / std).reshape(-1, *fields.shape[2:])
            for k in range(unrolled + 1)
        ]

    train_in, train_out = samples(train, 1)
    test_in, test_out = samples(held_out, 1)
    training = samples(train, args.rollout_steps)
    gradient = RolloutGradient(args.rollout_gradient)
    if args.rollout:
        start = min(held_out.shape[1] // 2, held_out.shape[1] - 1 - args.rollout)
        rollout_start = (held_out[:, start] - mean[0]) / std[0]
        rollout_truth = (held_out[:, start + args.rollout] - mean[0]) / std[0]
    model = recipe_model(args.model, args.set)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = warmup_cosine(optimizer, ScheduleConfig(), args.steps)
    print(
        f"{args.model}: {sum(p.numel() for p in model.parameters())} parameters; "
        f"{len(train_in)} training pairs, {len(test_in)} held-out pairs"
    )
    symmetries = box_symmetries(tuple(velocity.shape[-3:])) if args.augment else None

    def error(prediction: torch.Tensor, truth: torch.Tensor) -> float:
        """The recipe's metric, averaged over the pairs: relative L2 in the data's units."""
        return relative_l2(prediction * std + mean, truth * std + mean).mean().item()

    @torch.no_grad()
    def held_out_errors() -> str:
        """The held-out one-step error, and after ``--rollout`` steps."""
        line = f"held-out pairs {error(model(test_in), test_out):.4f}"
        if args.rollout:
            state = rollout(model, rollout_start, args.rollout)[-1]
            line += f", after {args.rollout} steps {error(state, rollout_truth):.4f}"
        return line

    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        index = torch.randint(len(training[0]), (args.batch,))
        batch = [f[index] for f in training]
        if symmetries is not None:
            symmetry = symmetries[torch.randint(len(symmetries), ()).item()]
            batch = [((symmetry(f * std + mean)) - mean) / std for f in batch]
        loss = unrolled_loss(model, batch[0], batch[1:], F.mse_loss, gradient)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            elapsed = time.perf_counter() - started
            print(f"step {step} ({elapsed:.0f} s): {held_out_errors()}", flush=True)

    with torch.no_grad():
        train_error = error(model(train_in), train_out)
    persistence = f"persistence {error(test_in, test_out):.4f}"
    if args.rollout:
        persistence += f", after {args.rollout} steps {error(rollout_start, rollout_truth):.4f}"
    print(
        f"after {args.steps} steps ({time.perf_counter() - started:.0f} s): one-step relative L2 "
        f"on training pairs {train_error:.4f} (persistence {error(train_in, train_out):.4f}),"
        f" on {held_out_errors()} ({persistence})"
    )


if __name__ == "__main__":
    main()
