"""Imported by every Python process started with this directory on ``PYTHONPATH`` (the ranks
of ``benchmarks.train_step_parts``' runs): with ``STEP_PARTS_DIR`` set, times the parts of
``train.py``'s steps (NOTE [The parts of a step] in ``benchmarks/train_step_parts.py``)."""

import os

if os.environ.get("STEP_PARTS_DIR"):
    from benchmarks.train_step_parts import install_step_clock

    install_step_clock(os.environ["STEP_PARTS_DIR"])
