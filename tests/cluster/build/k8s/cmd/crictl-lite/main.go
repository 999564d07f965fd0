// crictl-lite: the two CRI calls the local node needs, for a containerd it started.
//
// cri-tools' crictl is not served by the module proxy; these are built from the
// Kubernetes CRI client the kubelet itself uses.
//
//	crictl-lite -endpoint unix:///path/containerd.sock reset
//	    stop and remove every pod sandbox (the runtime tears down each pod's network
//	    through CNI and unmounts its /dev/shm), then every container left
//	crictl-lite -endpoint ... containers
//	    one JSON object a line: namespace, pod, container, id, state, pid, attempt
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	internalapi "k8s.io/cri-api/pkg/apis"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	remote "k8s.io/cri-client/pkg"
)

func main() {
	endpoint := flag.String("endpoint", "", "the runtime's CRI endpoint (unix://...)")
	timeout := flag.Duration("timeout", 60*time.Second, "for the whole command")
	flag.Parse()
	if *endpoint == "" || flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: crictl-lite -endpoint unix:///... reset|containers")
		os.Exit(2)
	}
	runtime, err := remote.NewRemoteRuntimeService(*endpoint, 10*time.Second, nil, nil)
	if err != nil {
		fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	switch flag.Arg(0) {
	case "reset":
		err = reset(ctx, runtime)
	case "containers":
		err = containers(ctx, runtime)
	default:
		err = fmt.Errorf("unknown command %q", flag.Arg(0))
	}
	if err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "crictl-lite:", err)
	os.Exit(1)
}

func reset(ctx context.Context, runtime internalapi.RuntimeService) error {
	sandboxes, err := runtime.ListPodSandbox(ctx, nil)
	if err != nil {
		return err
	}
	for _, sandbox := range sandboxes {
		if err := runtime.StopPodSandbox(ctx, sandbox.Id); err != nil {
			return fmt.Errorf("stop pod %s/%s: %w", sandbox.Metadata.Namespace, sandbox.Metadata.Name, err)
		}
		if err := runtime.RemovePodSandbox(ctx, sandbox.Id); err != nil {
			return fmt.Errorf("remove pod %s/%s: %w", sandbox.Metadata.Namespace, sandbox.Metadata.Name, err)
		}
	}
	left, err := runtime.ListContainers(ctx, nil)
	if err != nil {
		return err
	}
	for _, container := range left {
		if err := runtime.RemoveContainer(ctx, container.Id); err != nil {
			return fmt.Errorf("remove container %s: %w", container.Id, err)
		}
	}
	return nil
}

type row struct {
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	Container string `json:"container"`
	ID        string `json:"id"`
	State     string `json:"state"`
	Attempt   uint32 `json:"attempt"`
	Pid       int    `json:"pid"`
}

func containers(ctx context.Context, runtime internalapi.RuntimeService) error {
	listed, err := runtime.ListContainers(ctx, nil)
	if err != nil {
		return err
	}
	out := json.NewEncoder(os.Stdout)
	for _, container := range listed {
		r := row{
			Namespace: container.Labels["io.kubernetes.pod.namespace"],
			Pod:       container.Labels["io.kubernetes.pod.name"],
			Container: container.Labels["io.kubernetes.container.name"],
			ID:        container.Id,
			State:     container.State.String(),
			Attempt:   container.Metadata.Attempt,
		}
		if container.State == runtimeapi.ContainerState_CONTAINER_RUNNING {
			status, err := runtime.ContainerStatus(ctx, container.Id, true)
			if err != nil {
				return err
			}
			var info struct {
				Pid int `json:"pid"`
			}
			if raw, ok := status.Info["info"]; ok {
				_ = json.Unmarshal([]byte(raw), &info)
			}
			r.Pid = info.Pid
		}
		if err := out.Encode(r); err != nil {
			return err
		}
	}
	return nil
}
