set -o pipefail
export PYTHONUNBUFFERED=1 CODEGEN_CACHE_DIR=/tmp/cgc
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 -c "import torch, jinja2; print(torch.__version__, torch.version.cuda)"
python3 -m codegen demo 2>&1 | tee $OUT/demo.log
python3 -m pytest -m gpu -q -x 2>&1 | tee $OUT/gpu.log | tail -60
