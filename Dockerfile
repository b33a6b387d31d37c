# ddiloco in a container: `docker run IMAGE learn URL --learner-id ID`.
#
#   docker build -t ddiloco:cpu .                                   # CPU (syncer, CPU learners)
#   docker build -t ddiloco:cuda --build-arg VARIANT=cuda .          # NVIDIA GPUs (host driver + container toolkit)
#   docker run --rm ddiloco:cpu sync s3://my-bucket/runs/exp1 -o endpoint_url=...
#   docker run --rm --gpus all ddiloco:cuda learn s3://my-bucket/runs/exp1 --learner-id gpu-a --device cuda
#
# Signed runs (the default on s3:// and gs://): mount the learner's key read-only and
# readable by the image's user (uid 1000), with mode 0600 as ddiloco requires:
#   install -m 600 -o 1000 learner.pem /etc/ddiloco/learner.pem
#   docker run --rm -v /etc/ddiloco/learner.pem:/run/secrets/ddiloco.pem:ro -e DDILOCO_KEY=/run/secrets/ddiloco.pem \
#     ddiloco:cpu learn s3://my-bucket/runs/exp1 --learner-id a
#
# The CUDA variant needs no CUDA base image: PyPI's Linux torch wheels bring the CUDA
# runtime libraries with them; only the host's NVIDIA driver is used.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=plot,tensorboard,hf,yaml

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

# torch first, from the index of the chosen variant, so that installing ddiloco keeps it
RUN case "$VARIANT" in \
      cpu)  pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu ;; \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      *)    echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac

WORKDIR /opt/ddiloco
COPY pyproject.toml setup.py README.md ./
COPY ddiloco_cli ./ddiloco_cli
# gcc only while pip builds the compiled codec kernels (ddiloco_cli/numerics/_native.c), then removed;
# `ddiloco --version` says whether they are in use
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install ".[${EXTRAS}]" && python -c "import ddiloco_cli, torch; print('torch', torch.__version__)" \
 && ddiloco --version \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*

# training data and caches go to a writable home, not the image
RUN useradd --create-home --uid 1000 ddiloco
USER ddiloco
WORKDIR /home/ddiloco

ENTRYPOINT ["ddiloco"]
CMD ["--help"]
