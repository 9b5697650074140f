#!/usr/bin/env bash
# Nsight Compute over the triton vendor's kernels furthest from their bound (docs/gpu.md): W4A16 at
# M = 1 and 4096, paged prefill attention, dynamic_quant at prefill (benchmarks/gpu_kernel_profile.py).
#
# On the lent GPU machine (nothing to carry: it needs torch and Triton, which the image has):
#   run(command="bash scripts/gpu_profile.sh", timeout_s=240)
# Results in $OUT (or the first argument): ncu.log (ncu's output: with --log-file the CSV of every
# section's metrics, one row per metric and kernel, goes there too), ncu_metrics.csv (those CSV
# rows alone) and profiled_output.txt (the profiled script's own lines).
# Here, first (CPU, interpreter, tiny shapes, no ncu): bash scripts/gpu_profile.sh --dry-run
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ "${1:-}" == "--dry-run" ]]; then
  TRITON_INTERPRET=1 exec "$ROOT/.venv/bin/python" benchmarks/gpu_kernel_profile.py --dry-run
fi
OUTDIR="${1:-${OUT:-$ROOT/gpu_check_out}}"
mkdir -p "$OUTDIR"
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -1)"
[[ -x "$NCU" ]] || { echo "gpu_profile: ncu not found" >&2; exit 2; }
export PYTHONUNBUFFERED=1
"$NCU" --profile-from-start off --clock-control none \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --csv --page details --log-file "$OUTDIR/ncu.log" \
  python3 benchmarks/gpu_kernel_profile.py > "$OUTDIR/profiled_output.txt"
rc=$?
echo "gpu_profile: ncu exit $rc; $(wc -l < "$OUTDIR/profiled_output.txt") lines of the profiled script's output" >&2
# the headline of each kernel: its name, duration, memory and compute throughput (% of peak)
grep '^"' "$OUTDIR/ncu.log" > "$OUTDIR/ncu_metrics.csv"
python3 - "$OUTDIR/ncu_metrics.csv" <<'PY'
import csv, sys
keep = ("Duration", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
        "Registers Per Thread", "Grid Size", "Block Size")
with open(sys.argv[1]) as f:
    rows = [r for r in csv.reader(f) if len(r) > 14]
head = rows[0] if rows else []
col = {name: head.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")
       if name in head}
for r in rows[1:]:
    if len(col) == 5 and r[col["Metric Name"]] in keep:
        print(r[col["ID"]], r[col["Kernel Name"]][:40], r[col["Metric Name"]], r[col["Metric Value"]],
              r[col["Metric Unit"]])
PY
exit $rc
