# posenc artifacts as an image, for the Kubernetes init container (deploy/k8s): `make artifacts-image`.
#   docker build -f docker/artifacts.Dockerfile --build-arg WORKER_IMAGE=posenc-worker:latest -t posenc-artifacts artifacts
# The build context is the artifacts folder itself.  Built on the worker image: a node that runs the worker already
# has every layer but the last, and `cp` is there.  Running it copies /artifacts into whatever is mounted at
# /models (an emptyDir the worker then mounts read-only), as uid 10001 with a read-only root file system.
ARG WORKER_IMAGE=posenc-worker:latest
FROM ${WORKER_IMAGE}
USER 0:0
# /models owned by the worker's user: a fresh Docker volume mounted there takes over that ownership.
RUN mkdir -p /models && chown 10001:10001 /models
COPY . /artifacts/
USER 10001:10001
HEALTHCHECK NONE
ENTRYPOINT ["cp", "-R", "/artifacts/.", "/models/"]
CMD []
