# kvguard, the ext_proc admission controller: a small, non-root image that runs `kvguard serve`.
#
#   docker build -t kvguard .
#   docker run -v "$PWD/kvguard.yaml:/etc/kvguard/kvguard.yaml:ro" kvguard
#
# Health for probes: grpc.health.v1 on server.grpc_listen (k8s native gRPC probes: service ""
# for readiness, "liveness" for liveness). Bind it to 0.0.0.0 in a pod so that the kubelet can
# reach it (KVGUARD_SERVER_GRPC_LISTEN=0.0.0.0:50051, or the file's server.grpc_listen).
#
# The base image is pinned by its exact tag, not by digest: no registry could be asked for the
# digest where this file was written. To pin it, take the index digest of this tag
# (`docker buildx imagetools inspect python:3.11.11-slim-bookworm`) and build with
# --build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:<digest>.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# --- build: the runtime venv from requirements.lock, and kvguard's wheel ----------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src

# Build tools (grpcio-tools, with which setup.py generates kvguard/v1 from proto/; setuptools),
# taken hash-pinned from the dev lock into a venv of their own that the image does not keep.
COPY requirements-dev.lock ./
# (awk keeps the lock's entries for these packages: the pin line and its --hash lines.)
RUN awk -v want="grpcio grpcio-tools protobuf setuptools" \
        'BEGIN { n = split(want, w, " "); for (i = 1; i <= n; i++) keep[w[i]] = 1; } \
         /^[^ #]/ { split($1, name, "=="); on = (name[1] in keep); } \
         on && !/^ *#/' requirements-dev.lock > build-tools.txt \
    && python -m venv /opt/build-tools \
    && /opt/build-tools/bin/pip install --no-cache-dir --require-hashes --no-deps -r build-tools.txt

# The runtime dependencies, exactly as locked; then opentelemetry-proto again, because
# xds-protos overwrites its modules with an older copy (tools/reinstall_from_lock.py says more).
COPY requirements.lock ./
COPY tools/reinstall_from_lock.py ./tools/
RUN python -m venv /opt/kvguard \
    && /opt/kvguard/bin/pip install --no-cache-dir --require-hashes -r requirements.lock \
    && /opt/kvguard/bin/python tools/reinstall_from_lock.py requirements.lock opentelemetry-proto

# kvguard itself: build the wheel (setup.py generates the gRPC API from proto/ as it builds, and
# envoy/envoy.yaml goes in as the demo's package data), install it without dependencies (they
# came from the lock above).
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY proto ./proto
COPY envoy/envoy.yaml ./envoy/
COPY kvguard ./kvguard
RUN /opt/build-tools/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation -w /wheels . \
    && /opt/kvguard/bin/pip install --no-cache-dir --no-deps /wheels/kvguard-*.whl \
    && /opt/kvguard/bin/python -m compileall -q /opt/kvguard/lib \
    && /opt/kvguard/bin/pip uninstall --yes pip setuptools

# --- runtime: the venv alone, as a non-root user -----------------------------------------------
FROM ${PYTHON_IMAGE}
# jemalloc in place of glibc's malloc: the tokenizers' Rust code allocates for every prompt it
# counts, and glibc's allocator makes that a large share of kvguard's CPU on long prompts
# (bench/bench_overhead.py measures it).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libjemalloc2=5.3.0-1 \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s "/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2" /usr/local/lib/libjemalloc.so.2
COPY --from=build /opt/kvguard /opt/kvguard
# 65532: the conventional "nonroot" uid/gid; it owns nothing in the image, which can then run
# with a read-only root filesystem (bytecode is compiled above; nothing is written at run time).
ENV PATH=/opt/kvguard/bin:$PATH \
    LD_PRELOAD=/usr/local/lib/libjemalloc.so.2 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
WORKDIR /tmp
# 50051: ext_proc + grpc.health.v1 (server.grpc_listen); 9464: Prometheus (server.metrics_listen).
EXPOSE 50051 9464
ENTRYPOINT ["kvguard", "serve"]
CMD ["--config", "/etc/kvguard/kvguard.yaml"]
