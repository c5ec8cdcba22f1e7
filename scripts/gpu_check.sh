#!/usr/bin/env bash
# The CUDA checks (tests/test_cuda.py: fp16, bitsandbytes on the GPU, QLoRA, DiLoCo under fp16) on a GPU machine
# whose $PYTHON (default python3; .venv/bin/python where trahiv is installed) has PyTorch with CUDA; trahiv's other
# dependencies come from .gpu/whl (scripts/gpu_wheels.sh) when that folder exists. Logs go to ${OUT:-/tmp/gpu_check}:
# pytest.log and peers.tgz (every peer's log and done.json).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_check}
python=${PYTHON:-python3}
mkdir -p "$out"
if [ -d .gpu/whl ]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$python" -c "import torch, bitsandbytes, hivemind, transformers, peft; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'bitsandbytes', bitsandbytes.__version__, 'hivemind', hivemind.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__)" || exit 1
rm -rf /tmp/gpu_check_tests
timeout "${GPU_CHECK_TIMEOUT:-420}" "$python" -m pytest -q -p no:cacheprovider --basetemp=/tmp/gpu_check_tests \
  -n "${GPU_CHECK_WORKERS:-5}" --dist load -rA tests/test_cuda.py "$@" 2>&1 | tee "$out/pytest.log"
status=${PIPESTATUS[0]}
tar czf "$out/peers.tgz" -C /tmp/gpu_check_tests . 2>/dev/null
echo "gpu_check: pytest exited with $status"
exit "$status"
