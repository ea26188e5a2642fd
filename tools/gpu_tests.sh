# Runs the demo and the GPU tests on a machine with a GPU:
#   bash tools/gpu_tests.sh            everything
#   bash tools/gpu_tests.sh -k EXPR    a subset of the GPU tests (no demo)
set -o pipefail
export PYTHONUNBUFFERED=1 CODEGEN_CACHE_DIR=${CODEGEN_CACHE_DIR:-/tmp/cgc}
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
if [ $# -eq 0 ]; then python3 -m codegen demo 2>&1 | tee $OUT/demo.log; fi
python3 -X faulthandler -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee $OUT/gpu.log | tail -80
if [ $# -eq 0 ]; then
  PYTHONPATH=. python3 tools/check_examples.py
  echo "== compute-sanitizer memcheck on every example"
  PYTHONPATH=. timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python3 tools/check_examples.py 2>&1 | tail -15
fi
