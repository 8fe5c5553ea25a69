"""Launch detection (torchrun, Slurm, single process), named device meshes, and what a
collective timeout means (NOTE [A rank that stops participating])."""

from shardsci.distributed._hangs import (
    CollectiveTimeout,
    explain_timeout,
    is_collective_timeout,
    report_wait_s,
)
from shardsci.distributed._launch import (
    LaunchEnv,
    LaunchError,
    detect_launch_env,
    device_for_local_rank,
    init_distributed,
)
from shardsci.distributed._mesh import (
    MeshSpec,
    build_mesh,
    mesh_axis_sizes,
    parse_mesh_shape,
    resolve_axis_names,
)

__all__ = [
    "CollectiveTimeout",
    "LaunchEnv",
    "LaunchError",
    "MeshSpec",
    "build_mesh",
    "detect_launch_env",
    "device_for_local_rank",
    "explain_timeout",
    "init_distributed",
    "is_collective_timeout",
    "mesh_axis_sizes",
    "parse_mesh_shape",
    "report_wait_s",
    "resolve_axis_names",
]
