"""MeshGraphNet (Pfaff et al., 2021) for fields on unstructured meshes, written for one device.

Encoder: an MLP lifts node features ``(N, F_v)`` and edge features ``(E, F_e)`` to latent
width H. Processor: blocks of message passing, each updating every edge from its own latent
and its two end nodes, ``e += MLP_e([e, x_src, x_dst])``, then every node from its latent and
the aggregate of its incoming edges, ``x += MLP_v([x, Σ_{e→v} e])``. Decoder: an MLP from
the node latents to ``(N, F_out)``.

NOTE [MeshGraphNet op set]
shardsci runs this module on a partitioned graph unchanged (``shardsci.graph``): node tensors
sharded on the node dim, edge tensors and the edge index on the edge dim, each rank holding
the edges that end at its nodes. The module therefore uses only ``Linear``, ``LayerNorm``,
pointwise activations, ``torch.cat`` along features, the gathers ``x[src]`` and ``x[dst]``,
and the aggregation ``zeros_like(x).index_add_(0, dst, e)`` (sum) or
``zeros_like(x).scatter_reduce_(0, dst, e, "mean" | "amax", include_self=False)``, all of which
have sharded handlers; aggregation writes into ``zeros_like`` of the node latents, so node and
edge latents share the width H. A node without incoming edges aggregates to 0.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

Aggregation = Literal["sum", "mean", "max"]
Activation = Literal["relu", "silu", "gelu"]

_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU}
_SCATTER_REDUCE = {"mean": "mean", "max": "amax"}


@dataclass(frozen=True)
class MeshGraphNetConfig:
    """Architecture of a :class:`MeshGraphNet`; validated on construction."""

    node_in: int = 3
    """Input features per node, F_v (e.g. velocity and a node-type one-hot)."""
    edge_in: int = 3
    """Input features per edge, F_e (e.g. the relative position of its ends and its length)."""
    node_out: int = 2
    """Output features per node, F_out."""
    hidden: int = 128
    """Latent width H of nodes and edges, and of every MLP's hidden layers."""
    processor_blocks: int = 15
    """Message-passing blocks between encoder and decoder."""
    mlp_layers: int = 2
    """Hidden layers of every MLP (each a Linear and an activation), before its output Linear."""
    aggregation: Aggregation = "sum"
    """How a node combines its incoming edge latents: ``"sum"``, ``"mean"`` or ``"max"``."""
    activation: Activation = "relu"
    """Nonlinearity of every hidden layer."""
    layer_norm: bool = True
    """LayerNorm on the output of every MLP but the decoder's."""

    def __post_init__(self) -> None:
        for name in ("node_in", "edge_in", "node_out", "hidden", "processor_blocks", "mlp_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, choices in (("aggregation", Aggregation), ("activation", Activation)):
            if getattr(self, name) not in get_args(choices):
                raise ValueError(
                    f"{name} must be one of {get_args(choices)}, got {getattr(self, name)!r}"
                )


def mlp(
    in_features: int, out_features: int, config: MeshGraphNetConfig, norm: bool
) -> nn.Sequential:
    """``config.mlp_layers`` × (Linear → activation), a Linear to ``out_features``, then a
    LayerNorm when ``norm``; ``(..., in_features) -> (..., out_features)``."""
    widths = [in_features] + [config.hidden] * config.mlp_layers
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [nn.Linear(width_in, width_out), _ACTIVATIONS[config.activation]()]
    layers.append(nn.Linear(widths[-1], out_features))
    if norm:
        layers.append(nn.LayerNorm(out_features))
    return nn.Sequential(*layers)


def aggregate(
    messages: torch.Tensor, dst: torch.Tensor, nodes: torch.Tensor, how: str
) -> torch.Tensor:
    """Combine ``messages`` ``(E, *B, H)`` at their destinations ``dst`` ``(E,)`` into
    ``(N, *B, H)``, shaped and laid out like ``nodes``."""
    out = torch.zeros_like(nodes)
    if how == "sum":
        return out.index_add_(0, dst, messages)
    index = dst.reshape(-1, *[1] * (messages.ndim - 1)).expand_as(messages)
    return out.scatter_reduce_(0, index, messages, _SCATTER_REDUCE[how], include_self=False)


class ProcessorBlock(nn.Module):
    """One message-passing step with residuals on nodes and edges."""

    def __init__(self, config: MeshGraphNetConfig) -> None:
        super().__init__()
        self.aggregation = config.aggregation
        self.edge_mlp = mlp(3 * config.hidden, config.hidden, config, config.layer_norm)
        self.node_mlp = mlp(2 * config.hidden, config.hidden, config, config.layer_norm)

    def forward(
        self,
        nodes: torch.Tensor,
        edges: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
        update_edges: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(N, *B, H)`` nodes and ``(E, *B, H)`` edges in, the same shapes out; edges
        ``None`` when not ``update_edges``. The last block's edges are read by nothing: a
        compiled block that returned them got autograd's zeros of the global edge shape
        as their gradient, on every rank (NOTE [torch.compile and ShardTensor])."""
        messages = self.edge_mlp(torch.cat([edges, nodes[src], nodes[dst]], dim=-1))
        incoming = aggregate(messages, dst, nodes, self.aggregation)
        nodes = nodes + self.node_mlp(torch.cat([nodes, incoming], dim=-1))
        return nodes, edges + messages if update_edges else None


class MeshGraphNet(nn.Module):
    """Encode-process-decode graph network; see NOTE [MeshGraphNet op set].

    Parameters
    ----------
    config
        Architecture; ``None`` for the defaults of :class:`MeshGraphNetConfig`.
    **overrides
        Fields of :class:`MeshGraphNetConfig` replacing those of ``config``,
        e.g. ``MeshGraphNet(hidden=64, processor_blocks=8)``.
    """

    def __init__(self, config: MeshGraphNetConfig | None = None, **overrides: object) -> None:
        super().__init__()
        self.config = dataclasses.replace(config or MeshGraphNetConfig(), **overrides)
        config = self.config
        self.node_encoder = mlp(config.node_in, config.hidden, config, config.layer_norm)
        self.edge_encoder = mlp(config.edge_in, config.hidden, config, config.layer_norm)
        self.processor = nn.ModuleList(
            ProcessorBlock(config) for _ in range(config.processor_blocks)
        )
        self.decoder = mlp(config.hidden, config.node_out, config, norm=False)

    def forward(
        self, node_features: torch.Tensor, edge_features: torch.Tensor, edge_index: torch.Tensor
    ) -> torch.Tensor:
        """Apply the network.

        Parameters
        ----------
        node_features
            ``(N, *B, F_v)``: optional batch dims B hold several samples on one mesh.
        edge_features
            ``(E, *B, F_e)``, one row per column of ``edge_index``, the same batch dims.
        edge_index
            ``(2, E)`` integer source and destination node of every edge, in ``[0, N)``.

        Returns
        -------
        torch.Tensor
            ``(N, *B, F_out)``.

        Raises
        ------
        ValueError
            If a shape does not match the configuration or the other inputs.
        """
        self._check_inputs(node_features.shape, edge_features.shape, edge_index.shape)
        src, dst = edge_index[0], edge_index[1]
        nodes = self.node_encoder(node_features)
        edges = self.edge_encoder(edge_features)
        last = len(self.processor) - 1
        for i, block in enumerate(self.processor):
            nodes, edges = block(nodes, edges, src, dst, update_edges=i < last)
        return self.decoder(nodes)

    def num_parameters(self) -> int:
        """Number of trainable scalars."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def _check_inputs(self, nodes: torch.Size, edges: torch.Size, edge_index: torch.Size) -> None:
        config = self.config
        if len(nodes) < 2 or nodes[-1] != config.node_in:
            raise ValueError(
                f"MeshGraphNet expects node features (N, *B, {config.node_in}), got shape "
                f"{tuple(nodes)}"
            )
        if len(edge_index) != 2 or edge_index[0] != 2:
            raise ValueError(
                f"MeshGraphNet expects edge_index (2, E), got shape {tuple(edge_index)}"
            )
        batch = tuple(nodes[1:-1])
        if tuple(edges) != (edge_index[1], *batch, config.edge_in):
            expected = (edge_index[1], *batch, config.edge_in)
            raise ValueError(
                f"MeshGraphNet expects edge features {expected} for {edge_index[1]} edges and "
                f"node features {tuple(nodes)}, got shape {tuple(edges)}"
            )
