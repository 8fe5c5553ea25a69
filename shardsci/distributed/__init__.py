"""Launch detection (torchrun, Slurm, single process) and named device meshes."""

from shardsci.distributed._launch import (
    LaunchEnv,
    LaunchError,
    detect_launch_env,
    device_for_local_rank,
    init_distributed,
)
from shardsci.distributed._mesh import build_mesh, mesh_axis_sizes, parse_mesh_shape

__all__ = [
    "LaunchEnv",
    "LaunchError",
    "build_mesh",
    "detect_launch_env",
    "device_for_local_rank",
    "init_distributed",
    "mesh_axis_sizes",
    "parse_mesh_shape",
]
