#!/usr/bin/env bash
# make images: every service's image built here without a container engine or a
# registry: buildah (vfs storage, chroot isolation) from Debian's packages, on base
# root filesystems made by mmdebstrap; written as OCI archives to build/images; then
# one service is run from its image until its health says SERVING.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
out="$repo/build/images"
suite=bookworm   # python3 is 3.11 there, as the services need
version=$(python3 -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' "$repo/pyproject.toml")
registry=registry.example.com/cairn
storage=(--root "$out/storage" --runroot "$out/run" --storage-driver vfs)
mkdir -p "$out"

missing=()
for tool in buildah mmdebstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ "${#missing[@]}" -gt 0 ]; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

has_image() { buildah "${storage[@]}" inspect --type image "$1" >/dev/null 2>&1; }

# A root filesystem from Debian's packages, committed as a local image.
base_image() {
  local name=$1; shift
  has_image "$name" && return
  mmdebstrap --variant=minbase --format=tar "$@" "$suite" "$out/rootfs.tar"
  local ctr mnt
  ctr=$(buildah "${storage[@]}" from scratch)
  mnt=$(buildah "${storage[@]}" mount "$ctr")
  tar -C "$mnt" -xf "$out/rootfs.tar"
  buildah "${storage[@]}" umount "$ctr" >/dev/null
  buildah "${storage[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah "${storage[@]}" commit -q "$ctr" "$name" >/dev/null
  buildah "${storage[@]}" rm "$ctr" >/dev/null
  rm -f "$out/rootfs.tar"
}

python_base=localhost/cairn-base/python:$suite
debian_base=localhost/cairn-base/debian:$suite
base_image "$python_base" --include=python3,python3-venv,ca-certificates
base_image "$debian_base" --include=ca-certificates

# The build stage of the proxy gets this machine's Go (the version go.mod asks for).
go_base=localhost/cairn-base/golang:$(go env GOVERSION)
if ! has_image "$go_base"; then
  ctr=$(buildah "${storage[@]}" from --pull=never "$debian_base")
  buildah "${storage[@]}" copy "$ctr" "$(go env GOROOT)" /usr/local/go >/dev/null
  buildah "${storage[@]}" config --env PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah "${storage[@]}" commit -q "$ctr" "$go_base" >/dev/null
  buildah "${storage[@]}" rm "$ctr" >/dev/null
fi

# RUN steps reach the package registries through this machine's trust store and pip
# settings, mounted for the build only: neither is written into an image.
build_trust=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
[ -f /etc/pip.conf ] && build_trust+=(-v /etc/pip.conf:/etc/pip.conf:ro)

for service in gateway retrieval memory orchestrator restproxy; do
  image="$registry/$service:$version"
  echo "== $image"
  buildah "${storage[@]}" bud --isolation chroot --layers --pull=never "${build_trust[@]}" \
    --build-arg PYTHON_IMAGE="$python_base" --build-arg GO_IMAGE="$go_base" --build-arg RUNTIME_IMAGE="$debian_base" \
    -f "$repo/services/$service/Containerfile" -t "$image" "$repo"
  rm -f "$out/$service.oci.tar"
  buildah "${storage[@]}" push -q "$image" "oci-archive:$out/$service.oci.tar:$image"
  echo "   $(du -h "$out/$service.oci.tar" | cut -f1) $out/$service.oci.tar"
done

"$repo/.venv/bin/python" "$repo/deploy/k8s/images/run_from_image.py" \
  --image "$registry/gateway:$version" --module cairn_gateway -- "${storage[@]}"
