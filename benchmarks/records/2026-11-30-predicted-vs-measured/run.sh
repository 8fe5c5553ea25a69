#!/bin/bash
# calib2's driver (issue 22 item 4): the family probes, then calibrate_steps for the five zoo
# models on planner18's 18:45 machine (2026-11-29-cost-model-remeasured/machine_1.json), each
# model's cost-model measurement made now (gloo), 3 rounds x 2 steps a call, 1/2/4 ranks.
# Run from the checkout with the venv active.
R=benchmarks/records/2026-11-30-predicted-vs-measured
M=benchmarks/records/2026-11-29-cost-model-remeasured/machine_1.json
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD
stamp() { echo "$1 $(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)" >> $R/run.load; }
stamp families-start
python $R/families.py 3 > $R/families_1.jsonl
stamp families-end
for m in ${MODELS:-unet fno vit transolver meshgraphnet}; do
  stamp cs_$m-start
  python -m benchmarks.calibrate_steps --models $m --machine $M > $R/cs_$m.jsonl 2> $R/cs_$m.err
  stamp cs_$m-end
done
stamp families2-start
python $R/families.py 3 > $R/families_2.jsonl
stamp families2-end
