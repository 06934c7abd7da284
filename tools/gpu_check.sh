#!/usr/bin/env bash
# One-command GPU check (issue [bench]); NOT part of the test suite. On one GPU, in under ~8 minutes:
#   1. bit identity of the token-code kernel and the fused residual add on CUDA for every dtype, the fused
#      QKV kernel and its gradient vs fp32 torch, a fused vs an unfused model (megafixed.bench.gpu_check verify);
#   2. the kernel sweep, forward (bf16 + fp32) and full (bf16), with CSV and the roofline PNG;
#   3. `megafixed bench train` of paper-1.7b-canonical and paper-1.7b-learned, bf16, mock data, ~30 steps each
#      (MFU, peak memory, overhead vs a bare torch loop);
#   4. one JSON (gpu_check.json) and a markdown table (gpu_check.md) of everything.
# Usage: tools/gpu_check.sh [OUT_DIR]   (default: $OUT if set, else gpu_check_out/)
# Knobs: GPU_CHECK_STEPS (30), GPU_CHECK_MICRO (4), GPU_CHECK_GLOBAL (8), GPU_CHECK_COMPILE (0; 1 = train.compile),
#        GPU_CHECK_SKIP_TRAIN=1 (kernels only). Each stage has its own time limit and a failed stage does not stop
#        the later ones; the exit code is 1 if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
unset DS_ACCELERATOR   # a CPU build box exports cpu; here DeepSpeed must pick CUDA
export PYTHONUNBUFFERED=1
STEPS="${GPU_CHECK_STEPS:-30}"; MICRO="${GPU_CHECK_MICRO:-4}"; GLOBAL="${GPU_CHECK_GLOBAL:-8}"
COMPILE="${GPU_CHECK_COMPILE:-0}"
status=0
t_start=$(date +%s)
stage() {  # stage NAME LIMIT_S CMD...: run with a time limit, log to OUT_DIR/NAME.log, remember failures
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(( $(date +%s) - t_start )) s elapsed)"
    if ! timeout "$limit" "$@" > >(tee "$OUT_DIR/$name.log") 2>&1; then
        echo "!!! stage $name failed or timed out (limit ${limit}s); see $OUT_DIR/$name.log"; status=1
    fi
}

# The package must resolve megafixed.kernels (kernels/ is installed under that name).
if ! python -c "import megafixed.kernels.fused_first_layer" 2>/dev/null; then
    pip install -q --no-deps -e . || { echo "cannot install megafixed"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT_DIR/gpu.txt"

stage verify 90 python -m megafixed.bench.gpu_check verify "$OUT_DIR/verify.json" cuda
SWEEP_TOKENS=4k,16k,64k,256k,1m
stage kernels_forward_bf16 80 python -m megafixed.cli bench kernels --device cuda --mode forward --dtype bfloat16 \
    --tokens "$SWEEP_TOKENS" --width 1024,2048,4096,8192 --warmup 10 --rep 40 \
    --json "$OUT_DIR/kernels_forward_bf16.json" --csv "$OUT_DIR/kernels_forward_bf16.csv" \
    --plot "$OUT_DIR/kernels_forward_bf16.png" --overwrite
stage kernels_forward_fp32 35 python -m megafixed.cli bench kernels --device cuda --mode forward --dtype float32 \
    --tokens 16k,256k,1m --width 2048,8192 --warmup 10 --rep 40 --providers megafixed-canonical,megafixed-gf2,torch-embedding \
    --json "$OUT_DIR/kernels_forward_fp32.json" --csv "$OUT_DIR/kernels_forward_fp32.csv" --overwrite
LIGER=$(python -c "import liger_kernel" 2>/dev/null && echo ,liger-embedding)
stage kernels_full 55 python -m megafixed.cli bench kernels --device cuda --mode full --dtype bfloat16 \
    --tokens "$SWEEP_TOKENS" --width 1024,2048,4096,8192 --providers "megafixed-canonical,megafixed-gf2,torch-embedding$LIGER" \
    --warmup 10 --rep 40 --json "$OUT_DIR/kernels_full.json" --csv "$OUT_DIR/kernels_full.csv" \
    --plot "$OUT_DIR/kernels_full.png" --overwrite
if [ "${GPU_CHECK_SKIP_TRAIN:-0}" != 1 ]; then
    for kind in canonical learned; do
        stage "train_$kind" 115 python -m megafixed.cli bench train "examples/configs/paper-1.7b-$kind.yaml" \
            data.mock=true train.precision=bf16 train.activation_checkpointing=false "train.compile=$([ "$COMPILE" = 1 ] && echo true || echo false)" \
            "train.micro_batch=$MICRO" "train.global_batch=$GLOBAL" "train.run_dir=$OUT_DIR/run_$kind" \
            --steps "$STEPS" --warmup-steps 3 --json "$OUT_DIR/train_$kind.json" --overwrite
    done
fi
python -m megafixed.bench.gpu_check report "$OUT_DIR" > /dev/null && echo "report: $OUT_DIR/gpu_check.md, $OUT_DIR/gpu_check.json"
echo "gpu_check done in $(( $(date +%s) - t_start )) s, status $status"
exit $status
