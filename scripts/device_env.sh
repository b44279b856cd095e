# Source this on the device machine (repo root): the package from source, carried wheels (fla-core) if any.
# Used as: `. scripts/device_env.sh && python3 benchmarks/...`
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
fi
mkdir -p /tmp/pp
ln -sfn "$PWD/src/transformers_k3" /tmp/pp/transformers_k3
ln -sfn "$PWD/kernels" /tmp/pp/k3_kernels
ln -sfn "$PWD/conversion" /tmp/pp/k3_conversion
export PYTHONPATH=/tmp/pp:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
