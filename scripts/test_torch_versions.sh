#!/usr/bin/env bash
# The test suite on a torch other than CI's: install this checkout into a virtual environment
# that already holds that torch, without letting pip touch it, then run the suite file by file.
#
#   scripts/test_torch_versions.sh VENV [--install-only] [--logs DIR] [TEST_FILE ...]
#
# VENV is a virtual environment whose torch is the version to test (make one with
# `python3 -m venv VENV && VENV/bin/pip install torch==2.11.0`: torch first, then this
# script). The project is installed editable with --no-deps, its other dependencies and dev
# extras by name from pyproject.toml under a constraint that holds torch at the installed
# version (none of them depends on torch; the constraint makes pip fail rather than replace
# it), then `pip check` must report nothing but torch's own CUDA wheels.
#
# Each test file (default: tests/test_*.py) runs in its own pytest process with
# OMP_NUM_THREADS=1 and the default marker selection (not slow), its output in
# DIR/<file>.log (default DIR: outputs/torch-<version>); DIR/summary.json and the table
# printed at the end give passed, failed, skipped and errors per file with its seconds.
# Exit status: 0 when no test failed or errored.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

usage() { echo "usage: $0 VENV [--install-only] [--logs DIR] [TEST_FILE ...]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
venv="$(cd "$1" && pwd)"; shift
python="$venv/bin/python"
[[ -x "$python" ]] || { echo "$venv has no bin/python: expected a virtual environment" >&2; exit 2; }
install_only=0
logs=""
files=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --install-only) install_only=1 ;;
        --logs) shift; [[ $# -gt 0 ]] || usage; logs="$1" ;;
        -*) usage ;;
        *) files+=("$1") ;;
    esac
    shift
done

torch_version="$("$python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" \
    || { echo "$venv has no importable torch: install the torch to test there first" >&2; exit 2; }
echo "torch $torch_version in $venv"

# ---------------------------------------------------------------------------- install
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
echo "torch==$torch_version" >"$constraint"
mapfile -t requirements < <("$python" - "$root/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for requirement in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
    if re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower() != "torch":
        print(requirement)
EOF
)
# Already installed from this checkout with every requirement met: nothing to fetch.
if [[ "$("$python" -c 'import shardsci, pathlib; print(pathlib.Path(shardsci.__file__).parents[1])' 2>/dev/null)" != "$root" ]] \
    || ! "$python" -m pip install -q --no-index --dry-run -c "$constraint" "${requirements[@]}" >/dev/null 2>&1; then
    "$python" -m pip install -q --no-deps -e "$root"
    "$python" -m pip install -q -c "$constraint" "${requirements[@]}"
fi
# torch's CUDA wheels (nvidia-*, cuda-*, triton) are torch's business: only the rest counts.
problems="$("$python" -m pip check 2>&1 | grep -v -E '^(No broken requirements|(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z-]+) )' || true)"
if [[ -n "$problems" ]]; then
    echo "pip check: $problems" >&2
    exit 1
fi
installed="$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')"
[[ "$installed" == "$torch_version" ]] || { echo "torch changed to $installed" >&2; exit 1; }
[[ $install_only -eq 1 ]] && exit 0

# ---------------------------------------------------------------------------- test
cd "$root"
logs="${logs:-outputs/torch-$torch_version}"
mkdir -p "$logs"
if [[ ${#files[@]} -eq 0 ]]; then
    files=(tests/test_*.py)
fi
for file in "${files[@]}"; do
    name="$(basename "$file" .py)"
    started=$(date +%s)
    OMP_NUM_THREADS=1 "$python" -m pytest -q -p no:cacheprovider "$file" \
        --junitxml="$logs/$name.xml" >"$logs/$name.log" 2>&1 || true
    echo "$name $(($(date +%s) - started)) s ($(tail -n 1 "$logs/$name.log"))"
done
"$python" - "$logs" "$torch_version" "${files[@]}" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

logs, version, files = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
rows = {}
for file in files:
    name = Path(file).stem
    try:
        suite = ET.parse(logs / f"{name}.xml").getroot().find("testsuite")
        counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
        counts["seconds"] = round(float(suite.get("time")), 1)
    except (OSError, ET.ParseError, AttributeError):
        counts = {"tests": 0, "failures": 0, "errors": 1, "skipped": 0, "seconds": 0.0}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    rows[name] = counts
total = {k: sum(r[k] for r in rows.values()) for k in ("passed", "failures", "errors", "skipped")}
total["seconds"] = round(sum(r["seconds"] for r in rows.values()), 1)
(logs / "summary.json").write_text(json.dumps({"torch": version, "files": rows, "total": total}, indent=1))
for name, r in rows.items():
    if r["failures"] or r["errors"]:
        print(f"FAILED {name}: {r['failures']} failed, {r['errors']} errors (see {logs}/{name}.log)")
print(f"torch {version}: {total['passed']} passed, {total['failures']} failed, "
      f"{total['errors']} errors, {total['skipped']} skipped in {total['seconds']} s "
      f"({len(rows)} files; {logs}/summary.json)")
sys.exit(1 if total["failures"] or total["errors"] else 0)
EOF
