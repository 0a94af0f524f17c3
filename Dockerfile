# syntax=docker/dockerfile:1
#
# Kiln: one image, several processes. The entrypoint is the `kiln` command; the chart picks the
# process with the arguments:
#   kiln api --host 0.0.0.0 --port 8000
#   kiln runtime --host 0.0.0.0 --port 8001
#   kiln worker -Q cpu,cpu.znver4 --concurrency 1
#
#   docker build -t kiln:0.1.0 .                      # CPU image (api, runtime, CPU workers)
#   docker build --target cuda -t kiln:0.1.0-cuda .   # GPU workers: CUDA base + the `cuda` extra
#
# The CPU image is the last stage, so a plain `docker build` makes it; BuildKit builds only the
# stages the chosen target needs.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_VERSION=12.4.1
ARG CUDA_OS=ubuntu22.04

# ---------------------------------------------------------------------------------------------
# GPU build: pycuda compiles from source against the toolkit's headers, so this stage starts
# from the CUDA *devel* image. libcuda.so comes from the driver on the GPU node at run time; the
# toolkit's stub stands in for it at link time.
FROM nvidia/cuda:${CUDA_VERSION}-devel-${CUDA_OS} AS cuda-build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LIBRARY_PATH=/usr/local/cuda/lib64/stubs
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY compiler_core/ compiler_core/
COPY artifact_store/ artifact_store/
COPY tuner_workers/ tuner_workers/
COPY api/ api/
COPY runtime_server/ runtime_server/
RUN pip install --no-cache-dir "./[cuda]"

# ---------------------------------------------------------------------------------------------
# GPU workers' image: the CUDA *runtime* base (no compiler toolkit: Kiln emits PTX with
# llvmlite and the driver JITs it), the same system packages and user as the CPU image.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${CUDA_OS} AS cuda
ENV DEBIAN_FRONTEND=noninteractive
# gcc + libc6-dev: the link driver, ld (binutils), crt files and libm/libgomp link stubs that
# compiler_core.codegen.native runs as `cc -shared ... -lgomp -lm`; libgomp1: OpenMP at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kiln \
    && useradd --system --uid 10001 --gid kiln --home-dir /var/lib/kiln --no-create-home \
       --shell /usr/sbin/nologin kiln \
    && install -d -o kiln -g kiln /var/lib/kiln
COPY --from=cuda-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/var/lib/kiln \
    KILN_DATA_DIR=/var/lib/kiln \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /var/lib/kiln
# Numeric, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
USER 10001:10001
ENTRYPOINT ["kiln"]
CMD ["worker", "-Q", "cuda.sm_90", "--concurrency", "1"]

# ---------------------------------------------------------------------------------------------
# CPU build: every dependency ships wheels, so no compiler is needed to install.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY compiler_core/ compiler_core/
COPY artifact_store/ artifact_store/
COPY tuner_workers/ tuner_workers/
COPY api/ api/
COPY runtime_server/ runtime_server/
RUN pip install --no-cache-dir .

# ---------------------------------------------------------------------------------------------
# The image (default target): slim Python, the virtual environment, and only what compiling a
# model needs at run time besides Python.
FROM ${PYTHON_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# gcc + libc6-dev: the link driver, ld (binutils), crt files and libm/libgomp link stubs that
# compiler_core.codegen.native runs as `cc -shared ... -lgomp -lm`; libgomp1: OpenMP at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kiln \
    && useradd --system --uid 10001 --gid kiln --home-dir /var/lib/kiln --no-create-home \
       --shell /usr/sbin/nologin kiln \
    && install -d -o kiln -g kiln /var/lib/kiln
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/var/lib/kiln \
    KILN_DATA_DIR=/var/lib/kiln \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /var/lib/kiln
# Numeric, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
USER 10001:10001
EXPOSE 8000 8001
ENTRYPOINT ["kiln"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]
