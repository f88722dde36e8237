# One image for every pdd service; compose.yaml picks the process with `command`.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU torch first, from the PyTorch CPU index: the project's torch requirement is then
# already met and pip never pulls the multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app

# Dependencies in their own layer (installed from pyproject.toml with empty packages), so
# editing the source does not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir -p shared services bench \
    && touch shared/__init__.py services/__init__.py bench/__init__.py \
    && pip install . \
    && pip uninstall -y pdd \
    && rm -rf shared services bench build ./*.egg-info

COPY shared shared
COPY services services
COPY bench bench
RUN pip install --no-deps . && rm -rf build ./*.egg-info

# Unprivileged user; /run/pdd holds the relay's unix socket (a volume shared with prefill),
# /pdd the credentials the compose `certs` service writes (a volume the others mount read-only).
RUN useradd --create-home --uid 10001 pdd \
    && mkdir -p /run/pdd && chown pdd /run/pdd \
    && mkdir -p /pdd && chown pdd /pdd
USER pdd

CMD ["pdd", "--help"]
