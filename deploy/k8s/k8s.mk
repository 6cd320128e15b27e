# Kubernetes verbs, included by the Makefile. Outside `make test`: they need root
# (Debian packages) and build large things from the Go module proxy.
.PHONY: k8s-verify

k8s-verify: ## a real kube-apiserver 1.34 on etcd: apply the CNPG CRDs, then each overlay with --dry-run=server
	bash deploy/k8s/verify/verify.sh

.PHONY: images
images: $(STAMP) web ## build every service's image with buildah (vfs, chroot) on mmdebstrap bases into build/images/*.oci.tar; run the gateway from its image
	bash deploy/k8s/images/images.sh
