#!/bin/bash
# planner18's driver: a second calibration (spread), then calibrate_steps for the four models
# on the first calibration's machine. Run from the checkout with the venv active.
R=benchmarks/records/2026-11-29-cost-model-remeasured
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD
stamp() { echo "$1 $(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)" >> $R/run_all.load; }
stamp calibrate_2-start
python -m benchmarks.calibrate --save $R/machine_2.json > $R/calibrate_2.jsonl 2>/dev/null
stamp calibrate_2-end
for m in fno vit transolver meshgraphnet; do
  stamp cs_$m-start
  python -m benchmarks.calibrate_steps --models $m --machine $R/machine_1.json > $R/cs_$m.jsonl 2>/dev/null
  stamp cs_$m-end
done
