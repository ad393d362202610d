#!/usr/bin/env bash
# make swarm-test: deploy/swarm/stack.yml on a real single-node swarm, rolled, killed and scaled under load.
# docker/build-image.sh installs the engine when missing, starts dockerd and builds the worker image offline (as
# for make compose-test); tests/deploy/swarm then initialises swarm mode, deploys, and takes it all down again,
# leaving the swarm it started (see its docstrings).  A dockerd this run started is stopped at the end.  The whole
# run is bounded (SWARM_TEST_SECONDS, default 900).  Figures: build/swarm-report.json, or the file named by
# POSENC_SWARM_REPORT (bench/results/swarm.json for a run meant to record them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
IMAGE=${POSENC_IMAGE:-posenc-worker:test}
export POSENC_CLIENT_IMAGE=${POSENC_CLIENT_IMAGE:-posenc-client:test}  # the load client's image (client/ inside)
t0=$(date +%s)
rm -f build/dockerd.pid
cleanup() {
  # Normally the tests leave nothing; after a hard stop (timeout) remove what they would have.
  if docker info >/dev/null 2>&1; then
    for s in $(docker stack ls --format '{{.Name}}' 2>/dev/null | grep '^posencst' || true); do
      echo "swarm-test: removing leftover stack $s"; docker stack rm "$s" >/dev/null 2>&1 || true
    done
    if [ -f build/swarm-started ] && [ "$(docker info --format '{{.Swarm.LocalNodeState}}')" = active ]; then
      echo "swarm-test: leaving the swarm this run started"; docker swarm leave --force >/dev/null 2>&1 || true
    fi
  fi
  rm -f build/swarm-started
  if [ -f build/dockerd.pid ]; then
    pid=$(cat build/dockerd.pid)
    echo "swarm-test: stopping the dockerd this run started ($pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    rm -f build/dockerd.pid
  fi
}
trap cleanup EXIT
base=$(PY=$PY POSENC_IMAGE=$IMAGE docker/build-image.sh | tail -1)
[ "$(docker info --format '{{.Swarm.LocalNodeState}}')" = inactive ] && touch build/swarm-started
echo "swarm-test [$(( $(date +%s) - t0 ))s] running tests/deploy/swarm"
POSENC_IMAGE=$IMAGE POSENC_BASE_IMAGE=$base POSENC_SWARM_TEST=1 \
  timeout -k 20 "${SWARM_TEST_SECONDS:-900}" "$PY" -m pytest -q -p no:cacheprovider tests/deploy/swarm
echo "swarm-test: done in $(( $(date +%s) - t0 )) s"
