# One device call: the GPU tests of the runtime, then a quick interleaved benchmark.
export CODEGEN_CACHE_DIR=${CODEGEN_CACHE_DIR:-/tmp/cgc2} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp}
timeout ${TEST_S:-150} python3 -X faulthandler -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee $OUT/gpu.log | tail -25
timeout ${BENCH_S:-90} python3 benchmarks/bench_matmul.py --quick 2>&1 | tee $OUT/bench.log | tail -40
