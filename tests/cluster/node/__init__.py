"""The local cluster's real node: kubelet, containerd, CNI, kube-proxy (realnode.py)."""
