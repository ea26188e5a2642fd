# On a machine with a GPU, from the checkout's root: the GPU tests, then the layer benchmarks
# (the MLPs against eager, the host cost of an elementwise op, the offloaded MLP against its
# copy floor). Everything it prints also goes to $OUT.
#   bash tools/gpu_quick.sh                            all GPU tests first
#   bash tools/gpu_quick.sh tests/test_layers_gpu.py   a subset
#   JOBS=3 bash tools/gpu_quick.sh                     the GPU tests in 3 processes at once
#                                                      (correctness only: they share the GPU)
#   LAYERS=0 bash tools/gpu_quick.sh                   without the layer benchmarks
#   TESTS=0 bash tools/gpu_quick.sh                    without the GPU tests
#   BENCH="copy matmul" bash tools/gpu_quick.sh        also benchmarks.bench_copy / bench_matmul
#   BENCH=offload bash tools/gpu_quick.sh              also offload_llama (prefill, decode eager
#                                                      and replayed, generate) and where the
#                                                      host waits in generate
#   BENCH=budget bash tools/gpu_quick.sh               also offload_budget (the 8B-shaped model
#                                                      at GPU budgets, accelerate, fp8, int4)
export CODEGEN_CACHE_DIR=${CODEGEN_CACHE_DIR:-/tmp/cgc2} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=.
OUT=${OUT:-/tmp}; mkdir -p $OUT/bm
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
if [ "${TESTS:-1}" = 0 ]; then
  : > $OUT/gpu.log
elif [ "${JOBS:-1}" -gt 1 ]; then
  # The GPU test files split into JOBS pytest processes, balanced by test count, each with
  # its own build cache; their logs are joined into gpu.log.
  python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider "$@" 2>/dev/null \
    | python3 -c '
import collections, sys
jobs = int(sys.argv[1]); counts = collections.Counter(
    line.split("::")[0] for line in sys.stdin if "::" in line)
groups = [[] for _ in range(jobs)]; load = [0] * jobs
for name, n in counts.most_common():
    i = load.index(min(load)); groups[i].append(name); load[i] += n
for g in groups: print(" ".join(g))' "$JOBS" > $OUT/gpu_groups.txt
  i=0; while read -r files; do i=$((i+1))
    CODEGEN_CACHE_DIR=$CODEGEN_CACHE_DIR/job$i timeout ${TEST_S:-330} python3 -X faulthandler \
      -m pytest -m gpu -q -p no:cacheprovider --tb=short -rfEs $files > $OUT/gpu.$i.log 2>&1 &
  done < $OUT/gpu_groups.txt
  wait; cat $OUT/gpu.*.log > $OUT/gpu.log; rm $OUT/gpu.*.log $OUT/gpu_groups.txt
  echo "pytest: $JOBS processes"
else
  timeout ${TEST_S:-330} python3 -X faulthandler -m pytest -m gpu -q -p no:cacheprovider \
    --tb=short -rfEs "$@" > $OUT/gpu.log 2>&1; echo "pytest exit $?"
fi
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu.log | tail -40
if [ "${LAYERS:-1}" = 1 ]; then
  timeout ${LAYERS_S:-100} python3 -m benchmarks.bench_layers --out $OUT $LAYERS_ARGS 2>&1 | tee $OUT/layers.log | tail -12
  timeout ${OFFLOAD_S:-150} python3 -m benchmarks.mlp_offload --out $OUT 2>&1 | tee $OUT/mlp_offload.log | tail -32
fi
case " $BENCH " in *" copy "*)
  timeout ${COPY_S:-150} python3 -m benchmarks.bench_copy --rounds ${COPY_ROUNDS:-9} --out $OUT 2>&1 | tee $OUT/copy.log | tail -22;;
esac
case " $BENCH " in *" matmul "*)
  timeout ${BENCH_S:-90} python3 -m benchmarks.bench_matmul --shapes bf16:8192,bf16:2048 --slices 1,4 --rounds ${BENCH_ROUNDS:-20} --no-plot --out $OUT/bm 2>&1 | tee $OUT/bench.log | tail -12;;
esac
case " $BENCH " in *" offload "*)
  timeout ${OFFLOAD_LLAMA_S:-300} python3 -m benchmarks.offload_llama --rounds ${OFFLOAD_ROUNDS:-3} --tokens ${OFFLOAD_TOKENS:-512,4096,1} --generate ${OFFLOAD_GENERATE:-8} --variants ${OFFLOAD_VARIANTS:-codegen,prefetch,prefetch_per_forward,gpu,copy,codegen_fp8,copy_fp8,codegen_int4,copy_int4} --out $OUT 2>&1 | tee $OUT/offload_llama.log | grep -v "^set up" | tail -24
  timeout ${GAPS_S:-150} python3 -m benchmarks.probes.offload_copy_gaps --generate 8 --configs default 2>&1 | grep -v -i warn | tee $OUT/offload_gaps.log | head -60;;
esac
case " $BENCH " in *" budget "*)
  timeout ${BUDGET_S:-420} python3 -m benchmarks.offload_budget --tokens ${BUDGET_TOKENS:-512,4096,1} --generate ${BUDGET_GENERATE:-3} --rounds ${BUDGET_ROUNDS:-2} --quantize fp8,int4 $BUDGET_ARGS --out $OUT 2>&1 | tee $OUT/offload_budget.log | grep -v "^set up" | tail -60;;
esac
