#!/usr/bin/env bash
# make compose-test: the docker compose deployment against a real Docker engine, from nothing.
# docker/build-image.sh installs the engine when missing, starts dockerd, makes the base image and builds the
# worker image offline; tests/compose then brings the stack up and takes it down (see its docstring).
# A dockerd this run started is stopped at the end.  Timings and the image size: build/compose-report.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
IMAGE=${POSENC_IMAGE:-posenc-worker:test}
t0=$(date +%s)
rm -f build/dockerd.pid
stop_dockerd() {
  if [ -f build/dockerd.pid ]; then
    pid=$(cat build/dockerd.pid)
    echo "compose-test: stopping the dockerd this run started ($pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    rm -f build/dockerd.pid
  fi
}
trap stop_dockerd EXIT
base=$(PY=$PY POSENC_IMAGE=$IMAGE docker/build-image.sh | tail -1)
echo "compose-test [$(( $(date +%s) - t0 ))s] running tests/compose"
POSENC_IMAGE=$IMAGE POSENC_BASE_IMAGE=$base POSENC_COMPOSE_TEST=1 "$PY" -m pytest -q -p no:cacheprovider tests/compose
echo "compose-test: done in $(( $(date +%s) - t0 )) s"
