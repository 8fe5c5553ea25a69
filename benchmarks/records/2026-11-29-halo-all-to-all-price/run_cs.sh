#!/bin/bash
# calibrate_steps on the UNet, main's all-to-all pricing (before) and the branch's (after), alternated
cd /work/wt/planner16; . .venv/bin/activate; export OMP_NUM_THREADS=1; export PYTHONPATH=$PWD
for i in 1 2; do
  for v in before after; do
    m=scratch/machine.json; [ $v = before ] && m=scratch/machine_before.json
    echo "$v $i start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> scratch/cs.load
    timeout 900 python -m benchmarks.calibrate_steps --models unet --machine $m --measured scratch/measured_unet.json > scratch/cs_${v}_$i.jsonl 2> scratch/cs_${v}_$i.err
    echo "$v $i end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> scratch/cs.load
  done
done
echo ALLDONE >> scratch/cs.load
