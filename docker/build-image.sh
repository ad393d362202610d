#!/usr/bin/env bash
# Builds the worker image offline, from nothing: make image (and the first half of make compose-test).
#   1. docker.io, docker-compose and debootstrap from Debian when missing (needs root)
#   2. dockerd started when none answers (pid in build/dockerd.pid, log in build/dockerd.log)
#   3. the base image: $POSENC_BASE_IMAGE, else python:3.11-slim when present, else a local debootstrap stand-in
#   4. a wheelhouse of requirements/worker.txt downloaded on the host; `docker build --network none`
# Prints the base image it used on the last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
IMAGE=${POSENC_IMAGE:-posenc-worker:latest}
STANDIN=posenc/python-standin:3.11-slim
mkdir -p build
t0=$(date +%s)
say() { echo "image [$(( $(date +%s) - t0 ))s] $*" >&2; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "image: needs ${missing[*]}; run as root or install them" >&2; exit 2; }
  say "installing ${missing[*]} (log: build/apt.log)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${missing[@]}" >build/apt.log 2>&1 \
    || { apt-get update -q >>build/apt.log 2>&1 && apt-get install -y -q "${missing[@]}" >>build/apt.log 2>&1; } \
    || { tail -20 build/apt.log >&2; exit 2; }
fi

if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log: build/dockerd.log)"
  setsid dockerd >build/dockerd.log 2>&1 </dev/null &
  echo $! >build/dockerd.pid
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 build/dockerd.log >&2; echo "image: dockerd did not come up" >&2; exit 2; }
fi

base=${POSENC_BASE_IMAGE:-}
if [ -z "$base" ]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1; then
    base=python:3.11-slim
  else
    base=$STANDIN
    if ! docker image inspect "$STANDIN" >/dev/null 2>&1; then
      say "python:3.11-slim is absent and no registry is reachable: building $STANDIN with debootstrap"
      docker/standin-base.sh "$STANDIN" build/standin >&2
    fi
  fi
fi
say "base image: $base"

say "wheelhouse: build/wheelhouse (log: build/wheelhouse.log)"
"$PY" -m pip download --disable-pip-version-check --only-binary :all: -r requirements/worker.txt \
  -d build/wheelhouse >build/wheelhouse.log 2>&1 || { tail -20 build/wheelhouse.log >&2; exit 1; }
say "building $IMAGE with --network none (log: build/docker-build.log)"
# The legacy builder: it needs no buildx plugin and honours --network none for every RUN step.
DOCKER_BUILDKIT=0 docker build --network none --build-arg "BASE_IMAGE=$base" -f docker/Dockerfile -t "$IMAGE" . \
  >build/docker-build.log 2>&1 || { tail -30 build/docker-build.log >&2; exit 1; }
say "built $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
CLIENT_IMAGE=${POSENC_CLIENT_IMAGE:-posenc-client:latest}
DOCKER_BUILDKIT=0 docker build --network none --build-arg "BASE_IMAGE=$base" -f docker/Dockerfile --target client \
  -t "$CLIENT_IMAGE" . >>build/docker-build.log 2>&1 || { tail -30 build/docker-build.log >&2; exit 1; }
say "built $CLIENT_IMAGE (the worker's runtime plus client/)"
echo "$base"
