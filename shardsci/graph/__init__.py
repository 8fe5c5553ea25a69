"""Graphs partitioned over a mesh axis: nodes, edges and their features as ShardTensors.

A partition (:func:`partition_nodes`, METIS or recursive coordinate bisection) numbers the
graph part by part (:class:`GraphPartition`); :class:`PartitionedGraph` lays it out over a
mesh axis, each rank holding its nodes, the edges ending at them and, through the gather
handlers, the halo of remote source nodes those edges read. Message-passing code written for
one device (``x[src]``, ``index_add_``, ``scatter_reduce``) runs on it unchanged.
:func:`read_rows` reads a rank's own nodes of a dataset stored in the graph's original order.
"""

from shardsci.graph._graph import PartitionedGraph
from shardsci.graph._io import read_rows
from shardsci.graph._partition import GraphPartition, partition_nodes

__all__ = ["GraphPartition", "PartitionedGraph", "partition_nodes", "read_rows"]
