"""Run the training command with counters, for ``tests/test_planned_once.py``.

``python tests/counted_run.py <counts file> <train.py arguments>``: every process of the run
(the launcher, the ranks it forks, or each rank torchrun starts) appends a line ``<pid> <what>``
to the counts file each time a run plan is constructed, a mesh shape is parsed from a string, a
DeviceMesh is initialised, an HDF5 file is opened (``open <path>``), ``parallel=auto`` searches
(``search``) or a process runs a chosen decomposition (``chose <mesh>``), and ``launcher`` once
when it starts the command. The counters wrap the library from outside: the constructor, the one
string parser, torch's ``init_device_mesh``, ``h5py.File``, the search and ``chosen_config``.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import h5py
import torch.distributed.device_mesh as device_mesh

import shardsci.distributed._mesh as mesh_module
import shardsci.planning._choose as choose_module
import shardsci.train
import shardsci.training._parallelism as parallelism

COUNTS = Path(sys.argv[1])


def record(what: str) -> None:
    with COUNTS.open("a") as file:  # appends of one short line are atomic
        file.write(f"{os.getpid()} {what}\n")


def counted(fn, what):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        label = what(*args, **kwargs)
        if label:
            record(label)
        return fn(*args, **kwargs)

    return wrapper


def _opened(self, name, *args, **kwargs) -> str | None:
    """An opening by path; h5py also wraps files already open (``dataset.file``) in ``File``."""
    return f"open {Path(name).resolve()}" if isinstance(name, (str, os.PathLike)) else None


plan_type = parallelism.ParallelPlan
plan_type.__init__ = counted(plan_type.__init__, lambda *a, **k: "plan")
mesh_module._axis_sizes = counted(
    mesh_module._axis_sizes, lambda spec: "parse" if isinstance(spec, str) else None
)
mesh_module.init_device_mesh = counted(mesh_module.init_device_mesh, lambda *a, **k: "device_mesh")
device_mesh.init_device_mesh = mesh_module.init_device_mesh
h5py.File.__init__ = counted(h5py.File.__init__, _opened)
choose_module.choose = counted(choose_module.choose, lambda *a, **k: "search")
choose_module.chosen_config = counted(
    choose_module.chosen_config, lambda cfg, decomposition: f"chose {decomposition.mesh}"
)

if __name__ == "__main__":
    record("launcher")
    sys.argv = ["train.py", *sys.argv[2:]]
    shardsci.train.main()
