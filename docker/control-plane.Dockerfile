# The control-plane image: `cadenza operator` and `cadenza gateway`, which import no torch.
#
#   make image
#   docker build -f docker/control-plane.Dockerfile .
#
# cadenza is installed without its dependencies; docker/control-plane.txt lists what the operator
# and the gateway import, each with the project's own version range (tests/test_images.py checks
# both: the ranges, and that these commands start with torch unimportable).
FROM python:3.11-slim-bookworm AS build
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
COPY docker/control-plane.txt /tmp/
RUN python -m venv /opt/cadenza \
 && /opt/cadenza/bin/pip install --no-cache-dir -r /tmp/control-plane.txt \
 && /opt/cadenza/bin/pip install --no-cache-dir --no-deps .

FROM python:3.11-slim-bookworm
RUN useradd --uid 65532 --create-home --home-dir /home/cadenza cadenza
COPY --from=build /opt/cadenza /opt/cadenza
ENV PATH=/opt/cadenza/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 65532
ENTRYPOINT ["cadenza"]
CMD ["operator", "--help"]
