#!/usr/bin/env bash
# The GPU check: one command, offline, on one GPU, within 480 s by default and 300 s with --quick (so that a
# rerun fits in the same device attempt). NOT part of the test suite (tests/test_gpu_check.py runs it on CPU up to its preflight).
#
#   on a CPU machine with the registry:  tools/device_wheels.sh .whl      (carry .whl along)
#   on the GPU machine:                  tools/gpu_check.sh [--quick]     (results in $OUT, else ./gpu_check_out)
#
# 1. Install without the network: megafixed is put on the path as it is (a folder of links, no build), the
#    carried wheels ($GPU_CHECK_WHEELS, default .whl) go into a temporary --target with --no-index --no-deps.
#    The interpreter is the first python3 on PATH.
# 2. Preflight (seconds): every engine imports, versions printed and checked, DeepSpeed's accelerator is cuda,
#    no DeepSpeed op is JIT-built. A failure names what is missing and stops (exit 2). With no CUDA device the
#    script stops here with exit 3 and the line "no CUDA device: preflight passed".
# 3. Stages, most valuable first, each under its own time limit and all under one deadline (GPU_CHECK_BUDGET_S,
#    default 280 s); a stage that would start past the deadline is cut, and the summary says so. A stage's
#    benchmarks write their JSON after every row, so one stopped at its limit still reports what it measured.
#    Then, unless --quick, the stages a slow run's user reaches for (a profiler trace and a memory snapshot,
#    the kernels against their compile-only roofline, float8 against bf16) under a deadline of their own,
#    PERF_BUDGET_S more (default 190 s): with the install, the whole check stays within 10 minutes.
# 4. $OUT gets three files, refreshed after every stage (so even a killed run leaves them): gpu_check.md (the
#    summary), gpu_check.json (every result) and gpu_check.tar.gz (every log, CSV, PNG and JSON).
#
# Knobs: --quick (the first stages only), GPU_CHECK_STAGES=verify,resume (rerun only those; default: all),
#        GPU_CHECK_BUDGET_S (280), GPU_CHECK_PERF_BUDGET_S (190),
#        GPU_CHECK_WHEELS (.whl), OUT (gpu_check_out). Exit: 0 all passed, 1 a stage failed or was cut or timed
#        out, 2 preflight failed, 3 no CUDA device (preflight passed).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
QUICK=0
if [ "${1:-}" = --quick ]; then QUICK=1; shift; fi
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
WHEELS="${GPU_CHECK_WHEELS:-.whl}"
BUDGET="${GPU_CHECK_BUDGET_S:-280}"
PERF_BUDGET="${GPU_CHECK_PERF_BUDGET_S:-190}"
STAGES="${GPU_CHECK_STAGES:-all}"
PY=$(command -v python3) || { echo "error: no python3 on PATH"; exit 2; }
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/megafixed-gpu-check.XXXXXX")
RES="$WORK/gpu_check"   # everything the tarball holds
mkdir -p "$RES"
trap 'rm -rf "$WORK"' EXIT
unset DS_ACCELERATOR   # a CPU build box exports cpu; here DeepSpeed must pick CUDA
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"  # must stay empty: no op is JIT-built
export MEGAFIXED_CACHE_DIR="${MEGAFIXED_CACHE_DIR:-$WORK/cache}"
t_start=$(date +%s)
elapsed() { echo $(( $(date +%s) - t_start )); }

package() {  # the three files in $OUT, from what $RES holds now
    "$PY" "$REPO/megafixed/bench/gpu_report.py" "$RES" "$OUT_DIR" > /dev/null 2>> "$RES/report.log" \
        || echo "report failed: see report.log in the tarball"
    tar -czf "$OUT_DIR/gpu_check.tar.gz.tmp" -C "$WORK" gpu_check && mv -f "$OUT_DIR/gpu_check.tar.gz.tmp" "$OUT_DIR/gpu_check.tar.gz"
}

# ---- 1. install, offline
SITE="$WORK/site"
mkdir -p "$SITE/pkg/megafixed" "$SITE/lib"
for entry in "$REPO"/megafixed/*; do ln -s "$entry" "$SITE/pkg/megafixed/"; done
ln -s "$REPO/kernels" "$SITE/pkg/megafixed/kernels"   # setup.py ships kernels/ as megafixed.kernels
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
    echo "installing ${#wheels[@]} carried wheels from $WHEELS (offline)"
    if ! timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE/lib" "${wheels[@]}" \
            > "$RES/install.log" 2>&1; then
        cat "$RES/install.log"; echo "error: installing the wheels in $WHEELS failed (log above)"; package; exit 2
    fi
else
    echo "no wheels in $WHEELS: using what this python has (build them with tools/device_wheels.sh $WHEELS)"
fi
export PYTHONPATH="$SITE/pkg:$SITE/lib${PYTHONPATH:+:$PYTHONPATH}"
# Not the working directory first on sys.path: from the repository root `megafixed` would resolve to the
# source folder, which lacks megafixed.kernels (setup.py maps kernels/ there; the link folder above does too).
export PYTHONSAFEPATH=1

# ---- 2. preflight
timeout 120 "$PY" -m megafixed.bench.gpu_check preflight "$RES/preflight.json" 2>&1 | tee "$RES/preflight.log"
pre=${PIPESTATUS[0]}
if [ "$pre" != 0 ] && [ "$pre" != 3 ]; then
    echo "preflight failed (exit $pre) after $(elapsed) s: see the lines above"; package; exit 2
fi
if [ "$pre" = 3 ]; then package; echo "no CUDA device: preflight passed"; exit 3; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$RES/gpu.txt" 2>&1

# ---- 3. stages
status=0
deadline=$(( t_start + BUDGET ))
wanted() { [ "$STAGES" = all ] || [[ ",$STAGES," == *",$1,"* ]]; }
stage() {  # stage NAME LIMIT_S CMD...: a time limit capped by the deadline, a log, a line in stages.tsv
    local name=$1 limit=$2; shift 2
    wanted "$name" || return 0
    local left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 5 ]; then
        echo "=== $name cut: the ${BUDGET} s budget is spent"; printf '%s\tcut\t0\t%s\n' "$name" "$limit" >> "$RES/stages.tsv"
        status=1; package; return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit} s, $(elapsed) s elapsed)"
    local t0 rc result
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" > >(tee "$RES/$name.log") 2>&1
    rc=$?
    case $rc in
        0) result=ok ;;
        124|137) result=timeout; status=1 ;;
        *) result="failed($rc)"; status=1 ;;
    esac
    [ "$result" = ok ] || echo "!!! stage $name: $result; see $name.log in the tarball"
    printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$(( $(date +%s) - t0 ))" "$limit" >> "$RES/stages.tsv"
    package
}
MF=("$PY" -m megafixed.cli)
GC=("$PY" -m megafixed.bench.gpu_check)
SMALL=(data.mock=true metrics.tensorboard=false validation.interval=0 metrics.interval=1)

stage verify 45 "${GC[@]}" verify "$RES/verify.json" cuda
stage engine_bf16 40 "${GC[@]}" engine "$RES/engine_bf16.json"
stage train_canonical 60 "${MF[@]}" bench train "$REPO"/examples/configs/paper-1.7b-canonical.yaml data.mock=true \
    train.precision=bf16 train.activation_checkpointing=false train.compile=false train.micro_batch=4 \
    train.global_batch=8 "train.run_dir=$WORK/run_canonical" --steps 8 --warmup-steps 2 --json "$RES/train_canonical.json"
stage resume 80 "${GC[@]}" resume "$RES/resume.json" "$WORK/resume"
stage resume_dropout 60 "${GC[@]}" resume_dropout "$RES/resume_dropout.json" "$WORK/resume_dropout"
stage fused_compile 60 "${GC[@]}" fused_compile "$RES/fused_compile.json"
stage cp_ring 100 "${GC[@]}" cp_ring "$RES/cp_ring.json" "$WORK/cp_ring"
stage kernels_forward 30 "${MF[@]}" bench kernels --device cuda --mode forward --dtype bfloat16,float32 \
    --tokens 16k,256k,1m --width 2048,8192 --warmup 5 --rep 20 --json "$RES/kernels_forward.json" \
    --csv "$RES/kernels_forward.csv" --plot "$RES/kernels_forward.png"
stage memcheck 60 "${GC[@]}" memcheck "$RES/memcheck.json"
stage fp16 20 "${MF[@]}" train "$REPO"/examples/configs/quickstart.yaml "${SMALL[@]}" train.precision=fp16 \
    train.max_steps=20 checkpoint.interval=1000 "train.run_dir=$WORK/run_fp16"
stage train_learned 45 "${MF[@]}" bench train "$REPO"/examples/configs/paper-1.7b-learned.yaml data.mock=true \
    train.precision=bf16 train.activation_checkpointing=false train.compile=false train.micro_batch=4 \
    train.global_batch=8 "train.run_dir=$WORK/run_learned" --steps 6 --warmup-steps 2 --json "$RES/train_learned.json"
stage paper_settings 90 "${MF[@]}" bench train "$REPO"/examples/configs/paper-1.7b-canonical.yaml data.mock=true \
    train.precision=bf16 train.activation_checkpointing=true train.compile=true train.micro_batch=4 \
    train.global_batch=8 "train.run_dir=$WORK/run_paper" --steps 4 --warmup-steps 2 --no-bare \
    --json "$RES/train_paper_settings.json"
stage kernels_full 25 "${MF[@]}" bench kernels --device cuda --mode full --dtype bfloat16 --tokens 16k,256k,1m \
    --width 2048,8192 --providers megafixed-canonical,megafixed-gf2,torch-embedding --warmup 5 --rep 20 \
    --json "$RES/kernels_full.json" --csv "$RES/kernels_full.csv" --plot "$RES/kernels_full.png"
stage eval_generate 30 "${GC[@]}" eval_generate "$RES/eval_generate.json" "$WORK/resume/sync"

# ---- the stages for a slow run (not with --quick), on a deadline of their own after the first stages'
if [ "$QUICK" = 0 ]; then
    deadline=$(( $(date +%s) + PERF_BUDGET ))
    BUDGET=$PERF_BUDGET   # what a cut stage's line names
    stage profile 40 "${GC[@]}" profile "$RES/profile.json" "$WORK/profile"
    stage kernels_roofline 40 "${GC[@]}" kernels_roofline "$RES/kernels_roofline.json" "$RES/kernels_forward.json" \
        "$RES/roofline"
    stage float8 100 "${GC[@]}" float8 "$RES/float8.json" "$WORK/float8"
fi

leftover=$(find "$TORCH_EXTENSIONS_DIR" -type f 2>/dev/null | head -3)
[ -z "$leftover" ] || { echo "!!! a DeepSpeed op was JIT-built: $leftover"; status=1; }
package
echo "gpu_check done in $(elapsed) s, status $status: $OUT_DIR/gpu_check.md, gpu_check.json, gpu_check.tar.gz"
exit $status
