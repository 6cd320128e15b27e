#!/usr/bin/env bash
# make k8s-verify: a real kube-apiserver 1.34 (built by the wrapper module beside this
# script) on Debian's etcd accepts the CloudNativePG CRDs, then every overlay in a
# server-side dry run, with no warning (Pod Security "restricted" included).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
bin="$repo/build/k8s/bin"
crds="$repo/../shared/k8s/crds"
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

if ! command -v etcd >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends etcd-server
fi
if [ ! -x "$bin/kube-apiserver" ]; then
  mkdir -p "$bin"
  version=$(cd "$repo/deploy/k8s/verify" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
  minor=$(echo "$version" | cut -d. -f2)
  (cd "$repo/deploy/k8s/verify" && go build -o "$bin/" -ldflags "-X k8s.io/component-base/version.gitVersion=$version \
    -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor" \
    k8s.io/kubernetes/cmd/kube-apiserver)
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
etcd_client=$(free_port); etcd_peer=$(free_port); api_port=$(free_port)

etcd --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$etcd_client" \
  --advertise-client-urls "http://127.0.0.1:$etcd_client" --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
  > "$work/etcd.log" 2>&1 &
pids+=($!)

openssl genrsa -out "$work/sa.key" 2048 2>/dev/null
openssl rsa -in "$work/sa.key" -pubout -out "$work/sa.pub" 2>/dev/null
token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
echo "$token,admin,admin,system:masters" > "$work/tokens.csv"

"$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_client" \
  --bind-address 127.0.0.1 --secure-port "$api_port" --cert-dir "$work/certs" \
  --service-account-issuer https://kubernetes.default.svc --service-account-key-file "$work/sa.pub" \
  --service-account-signing-key-file "$work/sa.key" --token-auth-file "$work/tokens.csv" \
  --authorization-mode RBAC --service-cluster-ip-range 10.96.0.0/16 \
  > "$work/apiserver.log" 2>&1 &
pids+=($!)

export KUBECONFIG="$work/kubeconfig"
kubectl config set-cluster verify --server "https://127.0.0.1:$api_port" --insecure-skip-tls-verify=true >/dev/null
kubectl config set-credentials admin --token "$token" >/dev/null
kubectl config set-context verify --cluster verify --user admin >/dev/null
kubectl config use-context verify >/dev/null

for _ in $(seq 1 120); do
  if kubectl get --raw /readyz >/dev/null 2>&1; then break; fi
  if ! kill -0 "${pids[1]}" 2>/dev/null; then tail -20 "$work/apiserver.log"; exit 1; fi
  sleep 1
done
kubectl get --raw /readyz >/dev/null || { tail -20 "$work/apiserver.log"; exit 1; }
echo "kube-apiserver $(kubectl get --raw /version | python3 -c 'import json,sys; print(json.load(sys.stdin)["gitVersion"])') on etcd $(etcd --version | head -1 | awk '{print $3}')"

kubectl apply --server-side -f "$crds"
kubectl wait --for condition=Established --timeout 60s -f "$crds"
# Namespaced objects need their namespace to exist for a dry run: it is applied for
# real (with its Pod Security labels, so "restricted" is checked), then dry-run again
# with everything else.
kubectl apply -f "$repo/deploy/k8s/base/common/namespace.yaml"

# The check can fail: a pod template that is not "restricted" draws a warning.
kubectl create deployment pss-probe --image=registry.example.com/probe:1.0 --dry-run=client -o yaml \
  | kubectl -n cairn apply --dry-run=server -f - 2> "$work/probe.err" >/dev/null
grep -q 'violate PodSecurity "restricted' "$work/probe.err" || { echo "Pod Security is not checked"; exit 1; }

status=0
for overlay in dev prod; do
  echo "== overlay $overlay: kubectl apply --dry-run=server"
  kubectl kustomize "$repo/deploy/k8s/overlays/$overlay" > "$work/$overlay.yaml"
  if ! kubectl apply --dry-run=server -f "$work/$overlay.yaml" > "$work/$overlay.out" 2> "$work/$overlay.err"; then
    status=1
  fi
  cat "$work/$overlay.out"
  if [ -s "$work/$overlay.err" ]; then
    cat "$work/$overlay.err"
    status=1
  fi
  echo "== overlay $overlay: $(grep -c 'dry run' "$work/$overlay.out") objects accepted, $(grep -c . "$work/$overlay.err" || true) warnings or errors"
done
exit "$status"
