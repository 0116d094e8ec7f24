# pdserve's container image: `make image` builds it. One image runs every pdserve process on Kubernetes: the
# router and the controller (ENTRYPOINT pdserve), and the KubeRay head and worker pods (KubeRay replaces the
# command with its `ray start`; the worker actors then run pdserve's code from this same environment).

# CUDA runtime base, pinned by exact tag (not a moving one such as `latest` or `12-runtime`): CUDA 12.8.1 with
# cuDNN on Ubuntu 24.04, matching the CUDA 12.8 build of torch installed below.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# torch comes first and from PyTorch's CUDA 12.8 index. Locally the Makefile installs the same version from the
# default index, which on the development machines resolves to the CPU build; here the GPU build is the point.
# The version is pyproject's pin (2.13.0), so `pip install .` below finds the requirement met (a local label
# such as +cu128 satisfies ==2.13.0) and keeps the CUDA build instead of replacing it.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH \
    PDSERVE_CACHE_DIR=/models

# bash and wget: KubeRay runs `ray start` under bash and its default probes with wget.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates bash wget \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/pdserve

RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The project itself (not editable: the source tree stays out of the image).
COPY pyproject.toml README.md LICENSE /tmp/pdserve-src/
COPY src /tmp/pdserve-src/src
COPY services /tmp/pdserve-src/services
COPY loadgen /tmp/pdserve-src/loadgen
RUN pip install --no-cache-dir /tmp/pdserve-src && rm -rf /tmp/pdserve-src

# A non-root user with uid 1000 (the chart's runAsUser); Ubuntu 24.04 images already give uid 1000 to `ubuntu`.
RUN userdel --remove ubuntu 2>/dev/null || true \
    && useradd --uid 1000 --user-group --create-home --shell /bin/bash pdserve \
    && mkdir -p /models \
    && chown pdserve:pdserve /models
USER 1000:1000
WORKDIR /home/pdserve

ENTRYPOINT ["pdserve"]
CMD ["--help"]
