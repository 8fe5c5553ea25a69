"""3-D incompressible Navier–Stokes in a periodic box: the solver (``navier_stokes.py``) and the
dataset generator (``generate.py``) of the ``cfd3d`` recipe, which registers itself here once
it is wired (issue 19)."""
