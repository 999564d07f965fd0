#!/usr/bin/env bash
# Builds the local control plane's binaries once into ~/.cache/weightsync/bin/<key>/.
#
# k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces every k8s.io/*
# staging module with ./staging. The wrapper module beside this script requires
# k8s.io/kubernetes and pins each staging module to the matching v0.x release, so
# the real release builds from the module proxy. etcd's server module has the same
# problem and builds from the same wrapper at the version Kubernetes itself names.
set -euo pipefail

K8S_VERSION=v1.34.4
STAGING_VERSION=v0.34.4
ETCD_VERSION=v3.6.4
# containerd 2: Debian's 1.6 cannot apply CDI specs, which DRA drivers hand GPUs out with.
CONTAINERD_VERSION=v2.2.9
KWOK_VERSION=v0.7.0
HELM_VERSION=v3.20.2
# The cluster's DNS: a CoreDNS of five plugins (coredns/ beside this script), built
# apart from the rest (its own key), linked into the binaries' directory.
COREDNS_VERSION=v1.12.4

here=$(cd "$(dirname "$0")" && pwd)
cache=${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}
go_version=$(go env GOVERSION)
# The wrapper module's sums and tools are part of the key: a new binary means a new dir.
wrapper=$(cat "$here/k8s/go.sum" "$here"/k8s/cmd/*/*.go | sha256sum | cut -c1-8)
key="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_containerd-${CONTAINERD_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}_${go_version}_${wrapper}"
out="$cache/bin/$key"

log() { echo "[build] $(date +%H:%M:%S) $*" >&2; }

# CoreDNS first: a cache of the other binaries that predates it still serves.
coredns_key="coredns-${COREDNS_VERSION}_${go_version}_$(cat "$here"/coredns/go.sum "$here"/coredns/main.go | sha256sum | cut -c1-8)"
coredns="$cache/bin/$coredns_key/coredns"
if [ "${1:-}" != "--print-dir" ] && [ ! -x "$coredns" ]; then
  log "go build coredns $COREDNS_VERSION (about a minute)"
  mkdir -p "$(dirname "$coredns")"
  (cd "$here/coredns" && GOFLAGS="-mod=readonly -buildvcs=false" GOSUMDB=off CGO_ENABLED=0 \
    go build -trimpath -ldflags "-s -w" -o "$coredns.tmp" .)
  mv "$coredns.tmp" "$coredns"
fi
link_coredns() { ln -sfn "$coredns" "$1/coredns"; }

binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy crictl-lite fake-gpu-dra containerd containerd-shim-runc-v2 kwok helm)
if [ "${1:-}" = "--print-dir" ]; then echo "$out"; exit 0; fi
missing=0
for b in "${binaries[@]}"; do [ -x "$out/$b" ] || missing=1; done
[ -d "$out/kwok-stages" ] || missing=1
if [ "$missing" = 0 ]; then link_coredns "$out"; echo "$out"; exit 0; fi
log "building the control plane into $out (from nothing this takes about 9 minutes; later runs reuse it)"
mkdir -p "$out.tmp"
# The checksum database is not reachable everywhere; go.sum beside this script pins
# every module's hash instead, and -mod=readonly refuses anything not in it.
export GOFLAGS="-mod=readonly -buildvcs=false" GOSUMDB=off CGO_ENABLED=0
ldflags_k8s="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags_k8s+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=34"
  ldflags_k8s+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

cd "$here/k8s"
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do
  log "go build $cmd"
  go build -trimpath -ldflags "$ldflags_k8s" -o "$out.tmp/$cmd" "k8s.io/kubernetes/cmd/$cmd"
done
# crictl-lite (cmd/ in the wrapper): the CRI calls the real node's teardown needs.
log "go build crictl-lite"
go build -trimpath -ldflags "-s -w" -o "$out.tmp/crictl-lite" ./cmd/crictl-lite
# fake-gpu-dra (cmd/ in the wrapper): the real node's DRA driver for its fake GPUs.
log "go build fake-gpu-dra"
go build -trimpath -ldflags "-s -w" -o "$out.tmp/fake-gpu-dra" ./cmd/fake-gpu-dra
log "go build etcd $ETCD_VERSION"
go build -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3
"$out.tmp/etcd" --version | grep -q "${ETCD_VERSION#v}" || { log "etcd is not $ETCD_VERSION"; exit 1; }

export GOFLAGS="-buildvcs=false"
gobin="$out.tmp/gobin"
log "go install containerd $CONTAINERD_VERSION"
GOBIN="$gobin" go install -trimpath -ldflags "-s -w" \
  "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION"
mv "$gobin/containerd" "$gobin/containerd-shim-runc-v2" "$out.tmp/"
log "go install kwok $KWOK_VERSION"
GOBIN="$gobin" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
mv "$gobin/kwok" "$out.tmp/kwok"
rm -rf "$out.tmp/kwok-stages"
cp -r "$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage" "$out.tmp/kwok-stages"
chmod -R u+w "$out.tmp/kwok-stages"

# helm's Makefile stamps its version and the Kubernetes version it templates for;
# without them `.Capabilities.KubeVersion` claims v1.20.
log "go install helm $HELM_VERSION"
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=34"
done
GOBIN="$gobin" go install -trimpath -ldflags "$helm_ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
mv "$gobin/helm" "$out.tmp/helm"
rmdir "$gobin"

rm -rf "$out"
mv "$out.tmp" "$out"
link_coredns "$out"
log "done"
echo "$out"
