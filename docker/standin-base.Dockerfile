# The local stand-in for the images' real bases where no registry can be reached (`make images`
# with buildah here): Debian 12 (bookworm, Python 3.11, as python:3.11-slim) from a debootstrap
# root that docker/images.sh imports as ROOT, with a virtual environment on the PATH holding the
# wheelhouse's CPU torch and NumPy, as pytorch/pytorch holds its CUDA torch and NumPy. What it
# leaves unproven about the CUDA base: README "Containers".
ARG ROOT=localhost/swarmtrain-bookworm-root

FROM scratch AS wheels
COPY build/wheelhouse/ /

FROM ${ROOT}
ENV PATH=/opt/python/bin:${PATH} \
    PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/python
# the wheels it takes, named (docker/images.sh), so that a cached layer is reused only for them
ARG TORCH_PINS=unnamed
RUN --mount=type=bind,from=wheels,target=/wheels \
    echo "${TORCH_PINS}" \
    && pip install --no-cache-dir --no-index --find-links /wheels -c /wheels/requirements.lock torch numpy \
    && python -c "import torch; print('torch', torch.__version__)"
