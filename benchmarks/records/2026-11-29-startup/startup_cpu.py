"""CPU time of ``import shardsci.train`` (what each rank of the training command imports),
two virtual environments alternated: ``python startup_cpu.py OLD_PYTHON NEW_PYTHON``."""

import os
import resource
import statistics
import subprocess
import sys


def cpu_s(python: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([python, "-c", "import shardsci.train"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


if __name__ == "__main__":
    old, new = sys.argv[1:3]
    runs = {old: [], new: []}
    for _ in range(6):
        for python in (old, new):
            runs[python].append(cpu_s(python))
    for python, seconds in runs.items():
        print(
            f"{statistics.median(seconds):.2f} s [{min(seconds):.2f}-{max(seconds):.2f}] {python}"
        )
    print("new/old per pair:", [round(b / a, 3) for a, b in zip(runs[old], runs[new])])
    print("load:", os.getloadavg())
