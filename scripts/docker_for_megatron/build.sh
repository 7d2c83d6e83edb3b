#!/usr/bin/env bash
# Build the trinity-mcore GPU image from the repository root context.
#
#   scripts/docker_for_megatron/build.sh [TAG] [extra `docker build` arguments...]
#   scripts/docker_for_megatron/build.sh trinity-mcore:0.1.0 --no-cache
#
# The image's user gets your uid, so folders you bind-mount (models, data, checkpoints) stay writable
# from inside the container; set TRINITY_UID to choose another (>= 1000).
set -euo pipefail

tag="${1:-trinity-mcore:dev}"
if (($# > 0)); then
    shift
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../.." && pwd)"

uid="${TRINITY_UID:-$(id -u)}"
if ((uid < 1000)); then
    # root or a system account builds: a regular uid keeps the container unprivileged.
    uid=1000
fi

# BuildKit is what reads Dockerfile.dockerignore beside the Dockerfile (the context is the repo root).
DOCKER_BUILDKIT=1 docker build \
    --file "${here}/Dockerfile" \
    --tag "${tag}" \
    --build-arg "TRINITY_UID=${uid}" \
    "$@" \
    "${root}"

echo "built ${tag}; try: docker run --rm ${tag} trinity --help   (or docker run -it --rm ${tag} for a shell)"
