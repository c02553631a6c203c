#!/usr/bin/env bash
# The GPU checks as one prepared run for a one-GPU machine (the `device` tool's nvidia-h200, 15
# minutes of device time per session):
#   1. profile the GPU first (`python -m workbench.profile cluster=local_gpu --name gpu` at GPT-2
#      124M shape: its GEMMs, block, loss, optimizer and memory) into conf/cluster/gpu.yaml,
#      then benchmarks/gpu_predict.py: one-rank layouts predicted from that profile and from the
#      datasheet, then measured (the planner's accuracy on this device, at once);
#   2. benchmarks/gpu_mfu.py (1.24B Llama, bf16, fused AdamW, flash attention, compiled blocks,
#      30 steps) and the same eager, so the compile gain is measured in the same run;
#   3. (`lowrank`, a second command if time is left) the low-rank comparison at GPT-2 124M
#      shape (byte vocabulary) on one GPU, bf16: full rank, adaptive and fixed low rank at equal
#      tokens, through `python -m workbench.run ... tracking=none` (the image has no MLflow).
# The device image has torch but not Hydra/omegaconf: build their wheels here, carry them.
#
#   here:    bash benchmarks/gpu_session.sh prepare        # wheels -> .whl/ (git-ignored)
#   device:  run(command="bash benchmarks/gpu_session.sh run", carry=[".whl"], timeout_s=560)
#            run(command="bash benchmarks/gpu_session.sh lowrank local_gpu 200", carry=[".whl"])
#
# Figures land in $OUT (gpu.txt, profile.log, gpu.yaml, gpu_predict.log, gpu_mfu.log,
# gpu_mfu_eager.log); each part has its own timeout so one hang leaves the rest.
set -euo pipefail
cd "$(dirname "$0")/.."

lowrank_runs() {  # CLUSTER STEPS [EXTRA overrides...]: one line of figures per mode
  local cluster=$1 steps=$2 mode dir
  shift 2
  for mode in off adaptive fixed; do
    dir=/tmp/lowrank_$mode
    rm -rf "$dir"
    timeout 60 python3 -m workbench.run "cluster=$cluster" model=gpt2_124m model.vocab=256 \
      "lowrank=$mode" tracking=none "train.steps=$steps" train.global_batch=16 \
      train.micro_batch=16 train.eval_every=50 train.eval_batches=8 train.ckpt_every=100000 \
      "train.run_dir=$dir" "$@" 2>&1 | grep -E "^(final|error)" | sed "s/^/$mode: /" \
      || echo "$mode: failed or timed out"
    [ -f "$dir/rank_map.json" ] && python3 -c "import json, sys; m = json.load(open(sys.argv[1]));
print(sys.argv[2] + ': switch_step', m.get('switch_step'), 'layers', len(m.get('layers', {})))" \
      "$dir/rank_map.json" "$mode"
  done
  return 0
}
case "${1:-}" in
  prepare)
    python -m pip wheel --no-deps -w .whl omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 \
      "hydra-core==$(python -c 'import hydra; print(hydra.__version__)')"
    ;;
  run)
    out=${OUT:-/tmp/gpu_session}
    mkdir -p "$out"
    python3 -m pip install --quiet --no-index --no-deps --target /tmp/wbdeps .whl/*.whl
    export PYTHONPATH=/tmp/wbdeps:$PWD PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv \
      | tee "$out/gpu.txt"
    python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
    gpt2=(model=gpt2_124m model.vocab=256)
    rm -f conf/cluster/gpu.yaml
    timeout 150 python3 -m workbench.profile cluster=local_gpu --name gpu "${gpt2[@]}" 2>&1 \
      | tee "$out/profile.log" || true
    cp conf/cluster/gpu.yaml "$out/" 2>/dev/null || echo "no profile written" | tee -a "$out/profile.log"
    [ -f conf/cluster/gpu.yaml ] && { timeout 120 python3 benchmarks/gpu_predict.py cluster=gpu \
      "${gpt2[@]}" --datasheet local_gpu 2>&1 | tee "$out/gpu_predict.log" || true; }
    timeout 210 python3 benchmarks/gpu_mfu.py --steps 30 2>&1 | tee "$out/gpu_mfu.log" || true
    timeout 60 python3 benchmarks/gpu_mfu.py --steps 15 --warmup-steps 5 --no-compile 2>&1 \
      | tee "$out/gpu_mfu_eager.log" || true
    ;;
  lowrank)  # the comparison alone: lowrank CLUSTER STEPS [overrides...]; a CPU try:
    # bash benchmarks/gpu_session.sh lowrank local_cpu 8 model.n_layers=2 model.hidden=64 \
    #   model.ffn_hidden=128 model.n_heads=2 model.n_kv_heads=2 model.seq_len=64
    shift
    lowrank_runs "$@"
    ;;
  *)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
