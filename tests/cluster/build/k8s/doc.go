// Package controlplanebuild exists so that this wrapper is a module with a package;
// it requires k8s.io/kubernetes with its staging modules pinned to released
// versions, which lets `go build k8s.io/kubernetes/cmd/...` and etcd's server
// build from the module proxy. See ../build.sh.
package controlplanebuild
