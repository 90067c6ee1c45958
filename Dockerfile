# kvguard: the ext_proc admission controller. Build: docker build -t kvguard .
# Run: docker run -v $PWD/kvguard.yaml:/etc/kvguard/kvguard.yaml kvguard
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY requirements.lock pyproject.toml README.md ./
COPY kvguard ./kvguard
RUN python -m venv /opt/kvguard \
    && /opt/kvguard/bin/pip install --no-cache-dir --require-hashes -r requirements.lock \
    && /opt/kvguard/bin/pip install --no-cache-dir --no-deps --no-build-isolation .

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/kvguard /opt/kvguard
ENV PATH=/opt/kvguard/bin:$PATH PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 50051 9464
# Readiness and liveness: grpc.health.v1 on the gRPC port ("" and "liveness").
ENTRYPOINT ["kvguard", "serve"]
CMD ["--config", "/etc/kvguard/kvguard.yaml"]
