"""main's host fit (every timed call as per call + per ring step + per byte; no halo points) on
this calibration's points, and main's pricing of an all-to-all (its ring steps) expressed in
the branch's fields: the 'before' machine."""

import json
import sys
from pathlib import Path

from benchmarks.calibrate import nonnegative_fit, ring_steps

saved = json.loads(Path(sys.argv[1]).read_text())
timed = [p for p in saved["points"] if "pieces" not in p]
rows = [[1.0, float(ring_steps(p["kind"], p["ranks"])), p["received"]] for p in timed]
call, step, byte = nonnegative_fit(rows, [p["cpu_seconds"] for p in timed], [1.0] * len(rows))
machine = dict(saved["machine"])
machine.update(
    host_us_per_collective=call * 1e6,
    host_us_per_collective_step=step * 1e6,
    host_us_per_all_to_all=call * 1e6,
    host_us_per_all_to_all_peer=step * 1e6,
    host_s_per_byte_received=byte,
)
print({k: v for k, v in machine.items() if "host" in k}, file=sys.stderr)
Path(sys.argv[2]).write_text(json.dumps({"machine": machine}))
