# Crescent on a GPU box: one image, one process role per container (see docker-compose.yml).
# gcc: a CPU decode worker builds its paged attention kernel at first use (docs/deploy.md).
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-pip libibverbs1 librdmacm1 libnuma1 make \
        gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/crescent
COPY . .
RUN bash launch/setup.sh && .venv/bin/pip install -q ".[gpu]" || true
ENV PATH=/opt/crescent/.venv/bin:$PATH HF_HUB_OFFLINE=1
ENTRYPOINT ["crescent", "serve"]
