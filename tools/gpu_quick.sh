# One device call: the GPU tests, then the host-cost breakdown, the weight-streaming
# benchmark and the P1/P3 rows of the GEMM benchmark. Everything it prints also goes to
# $OUT (the device tool brings it back; at most 8 files).
#   bash tools/gpu_quick.sh                 all GPU tests first
#   bash tools/gpu_quick.sh tests/test_tp_gpu.py ...   a subset
export CODEGEN_CACHE_DIR=${CODEGEN_CACHE_DIR:-/tmp/cgc2} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=.
OUT=${OUT:-/tmp}; mkdir -p $OUT/bm
timeout ${TEST_S:-250} python3 -X faulthandler -m pytest -m gpu -q -p no:cacheprovider -rs "$@" 2>&1 | tee $OUT/gpu.log | tail -25
timeout ${HOST_S:-70} python3 benchmarks/host_cost.py --out $OUT 2>&1 | tee $OUT/host_cost.log | tail -42
timeout ${COPY_S:-150} python3 benchmarks/bench_copy.py --rounds ${COPY_ROUNDS:-9} --out $OUT 2>&1 | tee $OUT/copy.log | tail -22
timeout ${BENCH_S:-90} python3 benchmarks/bench_matmul.py --shapes bf16:8192,bf16:2048 --slices 1,4 --rounds ${BENCH_ROUNDS:-20} --no-plot --out $OUT/bm 2>&1 | tee $OUT/bench.log | tail -12
