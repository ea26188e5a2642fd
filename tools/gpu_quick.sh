# One device call: the GPU tests, then the host-cost breakdown, a quick interleaved
# benchmark and the one-rank tensor-parallel smoke run with traces. Everything it prints
# also goes to $OUT (the device tool brings it back).
#   bash tools/gpu_quick.sh                 all GPU tests first
#   bash tools/gpu_quick.sh tests/test_tp_gpu.py ...   a subset
export CODEGEN_CACHE_DIR=${CODEGEN_CACHE_DIR:-/tmp/cgc2} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=.
OUT=${OUT:-/tmp}; mkdir -p $OUT/tp  # at most 8 files come back
timeout ${TEST_S:-260} python3 -X faulthandler -m pytest -m gpu -q -p no:cacheprovider -rs "$@" 2>&1 | tee $OUT/gpu.log | tail -25
timeout ${HOST_S:-70} python3 benchmarks/host_cost.py --out $OUT 2>&1 | tee $OUT/host_cost.log | tail -40
timeout ${BENCH_S:-90} python3 benchmarks/bench_matmul.py --quick --no-plot --out /tmp/quick 2>&1 | tee $OUT/bench.log | tail -20
timeout ${TP_S:-60} python3 benchmarks/bench_overlap.py --world-size 1 --rounds 3 --warmup-s 0.3 --slices 4 --tokens 8192 --trace --out $OUT/tp 2>&1 | tee $OUT/overlap.log | tail -20
