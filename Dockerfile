# syntax=docker/dockerfile:1
# gpu-tune agent image: the agent, the MNIST probe with a CUDA-capable TensorFlow, jemalloc and
# numactl for the NUMA-pinned probe, and the MNIST data set baked in (no download at run time).
#
# Base: python:3.11-slim-bookworm + tensorflow[and-cuda] from PyPI rather than an nvidia/cuda
# runtime image. The pip extra installs exactly the CUDA, cuDNN, cuBLAS and NCCL wheels this
# TensorFlow release was built against, so the two cannot drift apart; the driver
# (libcuda, libnvidia-ml) comes from the host through the NVIDIA container runtime. The CUDA
# wheels dominate the size either way (~3.5 GB unpacked of a ~4 GB image); an nvidia/cuda
# cudnn-runtime base would be as large and add a second CUDA copy next to TensorFlow's.
#
#   docker build -t gpu-tune:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- build: a virtual environment at its final path -----------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The heavy, pinned part first so that it caches across source changes. The GPU TensorFlow
# replaces the "probe" extra (tensorflow-cpu), which must not be installed next to it.
RUN pip install --no-cache-dir "tensorflow[and-cuda]==2.21.0" "mlxtend==0.25.0"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent/ agent/
COPY workload/ workload/
COPY policies/ policies/
RUN pip install --no-cache-dir --no-compile /src

# ---- data: the full MNIST set in the Keras cache ----------------------------------------------
FROM build AS data
ENV KERAS_HOME=/opt/keras
# load_data() downloads mnist.npz and checks its hash; the probe then finds it in KERAS_HOME.
RUN python -c "import tensorflow as tf; tf.keras.datasets.mnist.load_data()" \
 && test -s /opt/keras/datasets/mnist.npz

# ---- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpu-tune" \
      org.opencontainers.image.description="Tune GPU nodes, label their NUMA/GPU topology, prove they are ready" \
      org.opencontainers.image.licenses="Apache-2.0"
# jemalloc: the probe preloads it (allocator check, require_jemalloc); numactl: NUMA pinning.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2=5.3.0-1 numactl=2.0.16-1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
COPY --from=data /opt/keras/datasets/mnist.npz /opt/keras/datasets/mnist.npz
ENV PATH=/opt/venv/bin:$PATH \
    KERAS_HOME=/opt/keras \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GPU_TUNE_ROOT=/host
# Runs as root on purpose: the agent writes kernel files of the host (docs/security.md). The
# DaemonSet mounts the host under /host and sets the profile and mode.
EXPOSE 9410
ENTRYPOINT ["gpu-tune"]
CMD ["serve", "--root", "/host", "--port", "9410", "--mode", "audit"]
