#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md on a lent CUDA machine (the device tool; never in CI):
#   1. install the wheels carried in .whl/ (packages that machine's image lacks) into /tmp/site;
#   2. the tests marked `gpu` (kernels, runner, CUDA graphs, copy streams, layer-wise, families);
#   3. `bench kernels` (bf16 and fp16) and `bench layerwise --device cuda` on SmolLM2's shape.
# Usage: scripts/gpu_check.sh OUTDIR [tests|kernels|layerwise]...   (no step named: all three)
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [steps]}
shift
steps=${*:-tests kernels layerwise}
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/device.txt"
for step in $steps; do
    case $step in
        tests) timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs 2>&1 | tee "$out/gpu_tests.log" ;;
        kernels)
            for dtype in bf16 fp16; do
                timeout 150 python3 -m mooncaked bench kernels --dtype $dtype --json "$out/kernels_$dtype.json" 2>&1 \
                    | tee "$out/kernels_$dtype.log"
            done ;;
        layerwise)
            timeout 200 python3 -m mooncaked bench layerwise --device cuda --model random:smollm2-135m \
                --lengths 1024,2048,4096 --rounds 5 --json "$out/layerwise.json" 2>&1 | tee "$out/layerwise.log" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
