#!/usr/bin/env bash
# An image holding an artifacts folder, for deploy/k8s's init container: make artifacts-image.
#   docker/build-artifacts-image.sh [ARTIFACTS_DIR] [TAG]      (defaults: ./artifacts, posenc-artifacts:latest)
# Needs the worker image ($POSENC_IMAGE, default posenc-worker:latest: make image) and builds with --network none.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-artifacts}
tag=${2:-${POSENC_ARTIFACTS_IMAGE:-posenc-artifacts:latest}}
worker=${POSENC_IMAGE:-posenc-worker:latest}
[ -d "$dir" ] && ls "$dir"/*/manifest.json >/dev/null 2>&1 \
  || { echo "artifacts-image: $dir holds no artifact (make models writes ./artifacts)" >&2; exit 2; }
docker image inspect "$worker" >/dev/null 2>&1 || { echo "artifacts-image: no image $worker (make image)" >&2; exit 2; }
chmod -R a+rX "$dir"  # the init container copies them as uid 10001
mkdir -p build
DOCKER_BUILDKIT=0 docker build --network none --build-arg "WORKER_IMAGE=$worker" -f docker/artifacts.Dockerfile \
  -t "$tag" "$dir" >build/artifacts-image.log 2>&1 || { tail -20 build/artifacts-image.log >&2; exit 1; }
echo "artifacts-image: built $tag from $dir ($(ls -d "$dir"/*/ | wc -l) models)"
