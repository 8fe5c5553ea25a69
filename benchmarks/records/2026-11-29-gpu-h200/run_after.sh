#!/usr/bin/env bash
# Second GPU call: the check after its fixes, a 256² step, the host price per op, torch 2.11 suite files.
O="$1"; cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
T0=$SECONDS
timeout -k 5 280 bash scripts/gpu_check.sh --out "$O/gc" > "$O/gpu_check.log" 2>&1; echo "gpu_check rc $? at $((SECONDS-T0)) s" >> "$O/gpu_check.log"
export PYTHONPATH="$PWD:/tmp/site"
timeout -k 5 50 python3 scripts/gpu_check.py --device cuda --size 256 --repeats 5 --variants eager bf16 --out "$O/gc/models256.json" > "$O/gc/models256.log" 2>&1; echo "256 rc $? at $((SECONDS-T0)) s" >> "$O/gpu_check.log"
OMP_NUM_THREADS=1 timeout -k 5 80 python3 -m benchmarks.calibrate_dispatch --repeats 5 --steps 5 > "$O/gc/calibrate_dispatch.jsonl" 2> "$O/gc/calibrate_dispatch.err"; echo "calibrate rc $? at $((SECONDS-T0)) s" >> "$O/gpu_check.log"
left=$((460 - (SECONDS - T0))); [ $left -gt 100 ] && left=100
if [ $left -gt 20 ]; then
  mkdir -p "$O/gc/s"; i=0
  for g in "tests/test_zoo_sharded.py" \
           "tests/test_attention_ops.py tests/test_matmul_attention.py tests/test_linear_node.py tests/test_autocast.py" \
           "tests/test_conv_ops.py tests/test_norm_ops.py tests/test_pool_ops.py tests/test_halo.py" \
           "tests/test_redistribute.py tests/test_api.py tests/test_multi_axis_mesh.py tests/test_training_step.py" \
           "tests/test_gather_scatter_ops.py tests/test_masked_ops.py tests/test_select_split_index.py tests/test_index_backward_memory.py" \
           "tests/test_compile.py tests/test_torch_compile_through.py tests/test_layout_memory.py tests/test_norm_statistics.py"; do
    i=$((i+1)); OMP_NUM_THREADS=1 timeout -k 5 $left python3 -m pytest -p no:cacheprovider -rf $g > "$O/gc/s/g$i.log" 2>&1 &
  done
  wait; echo "suite groups done at $((SECONDS-T0)) s" >> "$O/gpu_check.log"
fi
cd "$O" && tar czf gc.tgz --exclude=site gc && rm -rf gc
tail -c 3000 gpu_check.log
