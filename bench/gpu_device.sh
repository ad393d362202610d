#!/usr/bin/env bash
# posenc's worker on a lent GPU machine, in two calls (what travels per call is limited; see bench/gpu_carry.py):
#   bash bench/gpu_device.sh receive   # first call, carrying .gpu/prov: the CUDA provider library unpacked
#   bash bench/gpu_device.sh run       # second call on the same machine, carrying .gpu/ort .gpu/whl .gpu/pack
#   bash bench/gpu_device.sh step      # instead of run (same carry): bench.gpu_step, one decode step per KV placement
# The machine has python3 with numpy, the CUDA 13 libraries (nvidia-* wheels) and no package index.  Results go
# to $OUT (peers_gpu.json, peers_gpu.md, the workers' logs).
set -euo pipefail
SITE=/tmp/gpu-site
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$SITE/onnxruntime/capi" "$OUT"
case "${1:-}" in
receive)
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    .gpu/prov/libonnxruntime_providers_cuda.so.xz "$SITE/onnxruntime/capi/libonnxruntime_providers_cuda.so"
  ls -la "$SITE/onnxruntime/capi/"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv || true
  python3 --version
  python3 -m pip list 2>/dev/null | grep -i -E "^(numpy|protobuf|grpcio|onnxruntime|tokenizers|anyio|h11|click) " || true
  find /opt /usr -xdev \( -name 'libcublasLt.so.13*' -o -name 'libcudnn.so.9*' -o -name 'libcudart.so.13*' \
    -o -name 'libcufft.so.12*' -o -name 'libcurand.so.10*' \) 2>/dev/null | head -20 || true
  ;;
run|step)
  test -s "$SITE/onnxruntime/capi/libonnxruntime_providers_cuda.so" || { echo "run 'receive' first"; exit 2; }
  tar -xJf .gpu/ort/ort-rest.tar.xz -C "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/whl/*.whl
  export PYTHONPATH="$SITE:$PWD"
  # onnxruntime-gpu opens the CUDA libraries by name: the folders of the nvidia-* wheels already on the machine
  LIBS=$(find /opt /usr -xdev \( -name 'libcublasLt.so.13*' -o -name 'libcudnn.so.9*' -o -name 'libcudart.so.13*' \
    -o -name 'libcufft.so.12*' -o -name 'libcurand.so.10*' -o -name 'libnvrtc.so.13*' \) 2>/dev/null \
    | xargs -r -n1 dirname | sort -u | paste -sd:)
  export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  python3 -c "import onnxruntime as o; print(o.__file__, o.__version__, o.get_available_providers())"
  python3 -m bench gpu-pack unpack .gpu/pack --out /tmp/gpu-models
  export PYTHONUNBUFFERED=1
  if [ "$1" = step ]; then
    python3 -m bench gpu-step --artifact /tmp/gpu-models/smollm-redrawn --out "$OUT"
  else
    python3 -m bench peers-gpu --models /tmp/gpu-models --reference .gpu/pack/reference-32x128-64.json \
      --engines "${ENGINES:-cuda16,cuda,cpu:16}" --rounds "${ROUNDS:-3}" --out "$OUT"
  fi
  ;;
*)
  echo "usage: bash bench/gpu_device.sh receive|run|step" >&2
  exit 2
  ;;
esac
