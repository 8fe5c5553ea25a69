#!/usr/bin/env bash
# One command for a GPU machine: is shardsci right and how fast is it on this GPU?
#
#   scripts/gpu_check.sh [--dry-run] [--device cuda|cpu] [--out DIR]
#
# For a machine whose python3 already holds torch (2.11 on the GPU machines this project
# borrows) and nothing can be fetched: the project's other dependencies travel as wheels in
# .whl/ (README, "Torch versions"), installed with --no-deps --no-index into DIR/site, and
# shardsci itself is used from this checkout (PYTHONPATH), so pip never touches torch.
# Steps, each under its own time limit (8 minutes in all, wheels included):
#   1. environment: nvidia-smi, torch, CUDA, NCCL                        (DIR/environment.json)
#   2. pytest -m gpu tests/test_gpu.py: ShardTensors, halos, collectives, halo overlap on
#      the device's side stream (NOTE [Halo overlap on streams]),
#      every zoo model's float64 step against plain torch, NCCL world of one (DIR/gpu_tests.xml)
#   3. scripts/gpu_two_ranks.py: two ranks on the one GPU, NCCL's answer, then the same
#      checks on uneven shards over gloo with CUDA tensors, and ring attention under bf16
#      autocast against torch's SDPA (accuracy, peak memory)             (DIR/two_ranks.json)
#   4. scripts/gpu_check.py: every zoo model's step against plain torch, time and peak
#      memory, float32 and bf16 autocast                                  (DIR/models.json)
#   5. the same with compile_regions and torch.compile                    (DIR/compiled.json)
#   6. DIR/summary.json: all of them, with each step's status and seconds.
# NCCL takes one rank per GPU: step 3 records what it says to two, and runs them over gloo.
# --device cpu runs the same steps on the CPU with gloo (the GPU tests with
# SHARDSCI_TEST_DEVICE=cpu), which is what this machine can check; --dry-run prints the
# commands without running them. Exit status: 0 when every step passed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dry_run=0
device=cuda
out="$root/outputs/gpu_check"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --device) shift; device="${1:?--device needs cuda or cpu}" ;;
        --out) shift; out="${1:?--out needs a directory}" ;;
        *) echo "usage: $0 [--dry-run] [--device cuda|cpu] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
[[ "$device" == cuda || "$device" == cpu ]] || { echo "--device: cuda or cpu, not $device" >&2; exit 2; }
python="${PYTHON:-python3}"
statuses=()

run() {  # run NAME SECONDS COMMAND...: one step under a time limit, its status recorded
    local name="$1" limit="$2"; shift 2
    echo "+ [$name, at most ${limit} s] $*" >&2
    if [[ $dry_run -eq 1 ]]; then
        statuses+=("$name dry-run 0")
        return
    fi
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    statuses+=("$name $rc $((SECONDS - started))")
}

mkdir -p "$out"
cd "$root"
if compgen -G ".whl/*.whl" >/dev/null; then
    run wheels 30 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$out/site" .whl/*.whl
    export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export PYTHONUNBUFFERED=1

environment='import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
    "device": torch.cuda.get_device_name(0) if cuda else None,
    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}))'
run environment 30 bash -c "$python -c '$environment' >'$out/environment.json' && \
    (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >'$out/nvidia-smi.csv' || true)"

test_env=()
[[ "$device" == cpu ]] && test_env=(env SHARDSCI_TEST_DEVICE=cpu)
run gpu_tests 120 "${test_env[@]}" "$python" -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py --junitxml="$out/gpu_tests.xml"

run two_ranks 90 "$python" scripts/gpu_two_ranks.py --device "$device" --nccl-seconds 30 \
    --gloo-seconds 75 --out "$out/two_ranks.json"

size=64
[[ "$device" == cpu ]] && size=16
run models 90 "$python" scripts/gpu_check.py --device "$device" --size "$size" \
    --repeats 10 --variants eager bf16 --out "$out/models.json"
run compiled 150 "$python" scripts/gpu_check.py --device "$device" --size "$size" \
    --repeats 10 --variants compile_regions torch.compile --out "$out/compiled.json"

if [[ $dry_run -eq 1 ]]; then
    printf '%s\n' "${statuses[@]}"
    exit 0
fi
"$python" - "$out" "${statuses[@]}" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
steps = {}
for entry in sys.argv[2:]:
    name, rc, seconds = entry.split()
    steps[name] = {"exit_status": int(rc), "seconds": int(seconds),
                   "timed_out": int(rc) in (124, 137)}

def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError) as error:
        return {"error": str(error)}

try:
    suite = ET.parse(out / "gpu_tests.xml").getroot().find("testsuite")
    tests = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    tests["failed"] = [
        case.get("name") for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
except (OSError, ET.ParseError, AttributeError) as error:
    tests = {"error": str(error)}
summary = {
    "environment": load("environment.json"),
    "steps": steps,
    "gpu_tests": tests,
    "two_ranks": load("two_ranks.json"),
    "models": load("models.json"),
    "compiled": load("compiled.json"),
    "passed": all(s["exit_status"] == 0 for s in steps.values()),
}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({"steps": steps, "gpu_tests": tests, "passed": summary["passed"]}, indent=1))
print(f"summary: {out / 'summary.json'}")
sys.exit(0 if summary["passed"] else 1)
EOF
