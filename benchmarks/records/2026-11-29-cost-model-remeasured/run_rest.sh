#!/bin/bash
# planner18's second driver, after run_all.sh: the FNO's calibrate_steps (its first try failed
# to start its rank pools at load 46).
R=benchmarks/records/2026-11-29-cost-model-remeasured
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD
stamp() { echo "$1 $(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)" >> $R/run_all.load; }
while kill -0 "$1" 2>/dev/null; do sleep 5; done
stamp cs_fno_2-start
python -m benchmarks.calibrate_steps --models fno --machine $R/machine_1.json > $R/cs_fno.jsonl 2> $R/cs_fno.err
stamp cs_fno_2-end
