#!/usr/bin/env bash
# The engine issue's GPU check as one prepared run for a one-GPU machine (the `device` tool's
# nvidia-h200, 15 minutes of device time per session): benchmarks/gpu_mfu.py (1.24B Llama,
# bf16, fused AdamW, flash attention, compiled blocks, 30 steps) and the same eager, so the
# compile gain is measured in the same run. The device image has torch but not omegaconf,
# which workbench.config imports: build its wheels here, carry them.
#
#   here:    bash benchmarks/gpu_session.sh prepare        # wheels -> .whl/ (git-ignored)
#   device:  run(command="bash benchmarks/gpu_session.sh run", carry=[".whl"], timeout_s=540)
#
# Figures land in $OUT (gpu.txt, gpu_mfu.log, gpu_mfu_eager.log); each part has its own
# timeout so one hang leaves the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    python -m pip wheel --no-deps -w .whl omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
    ;;
  run)
    out=${OUT:-/tmp/gpu_session}
    mkdir -p "$out"
    python3 -m pip install --quiet --no-index --no-deps --target /tmp/wbdeps .whl/*.whl
    export PYTHONPATH=/tmp/wbdeps:$PWD PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv \
      | tee "$out/gpu.txt"
    python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
    timeout 300 python3 benchmarks/gpu_mfu.py --steps 30 2>&1 | tee "$out/gpu_mfu.log" || true
    timeout 150 python3 benchmarks/gpu_mfu.py --steps 15 --warmup-steps 5 --no-compile 2>&1 \
      | tee "$out/gpu_mfu_eager.log" || true
    ;;
  *)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
