# One image for all three services; compose.yaml starts each with its own command.
#
# Online (a registry and PyPI reachable):   docker build -t pagedserve:cpu .
# Offline (no registry, no network at all):  ./dev image   (deploy/build-image.sh: a debootstrapped
#   base image, a wheelhouse in deploy/wheelhouse/, then docker build --network=none ... OFFLINE=1)
#
# Build arguments:
#   BASE_IMAGE     any Debian-like image with python3 (3.11) and its venv module
#   TORCH_VARIANT  cpu (PyTorch's CPU wheel, the small image) or cuda (PyPI's CUDA wheel, for GPU hosts)
#   OFFLINE        1: install only from deploy/wheelhouse/ with pip --no-index; 0: from the network
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG OFFLINE=0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY deploy/wheelhouse /wheels
COPY deploy/pip-install.sh /pip-install.sh
# Dependencies first (this layer stays cached while only pagedserve's code changes), then pagedserve.
COPY pyproject.toml /src/
RUN TORCH_VARIANT=${TORCH_VARIANT} OFFLINE=${OFFLINE} sh /pip-install.sh deps /opt/pagedserve /src /wheels
COPY README.md /src/
COPY shared /src/shared
COPY kernels /src/kernels
COPY services /src/services
RUN TORCH_VARIANT=${TORCH_VARIANT} OFFLINE=${OFFLINE} sh /pip-install.sh project /opt/pagedserve /src /wheels

FROM ${BASE_IMAGE}
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="pagedserve" \
      org.opencontainers.image.description="PagedAttention LLM serving engine (torch ${TORCH_VARIANT})"
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pagedserve pagedserve \
 && install -d -o 10001 -g 10001 /home/pagedserve/.cache /home/pagedserve/.cache/pagedserve \
      /home/pagedserve/.cache/numba
COPY --from=build /opt/pagedserve /opt/pagedserve
# Logs as JSON lines; heartbeats for `pagedserve health` in the container's own /tmp; numba's
# compiled kernels and the embedded model's converted copy (shared/gguf_cache.py) in the user's
# home (site-packages is read-only for the user); nothing fetched;
# no progress bars between the JSON lines.
ENV PATH=/opt/pagedserve/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PAGEDSERVE_LOG_FORMAT=json \
    PAGEDSERVE_HEALTH_DIR=/tmp/pagedserve-health \
    NUMBA_CACHE_DIR=/home/pagedserve/.cache/numba \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TQDM_DISABLE=1
USER 10001:10001
WORKDIR /home/pagedserve
EXPOSE 8000
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0"]
