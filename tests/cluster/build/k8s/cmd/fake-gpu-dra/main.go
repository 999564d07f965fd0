// Command fake-gpu-dra is a Dynamic Resource Allocation driver for the local real node:
// it publishes the node's fake GPUs as a ResourceSlice and, when the kubelet prepares a
// claim, writes a CDI spec that gives every container naming the claim the allocated
// devices, the way a GPU vendor's DRA driver does (its CDI edits add device nodes and
// environment; these add environment only: FAKE_GPU_<index>=<uuid>, one per device).
//
// The scheduler allocates from the slice, the kubelet calls this plugin over the
// registration and DRA sockets, and containerd applies the CDI spec: every part but the
// hardware is the real one, so a test can check which devices reached which container.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
)

const (
	driverName = "gpu.fake.weightsync.io"
	cdiKind    = "fake.weightsync.io/gpu" // CDI's vendor/class
)

type driver struct {
	node   string
	cdiDir string
}

func uuid(node string, index int) string { return fmt.Sprintf("GPU-%s-%d", node, index) }

// cdiSpec is the part of the CDI specification (v0.6.0) these edits use.
type cdiSpec struct {
	Version string      `json:"cdiVersion"`
	Kind    string      `json:"kind"`
	Devices []cdiDevice `json:"devices"`
}

type cdiDevice struct {
	Name           string   `json:"name"`
	ContainerEdits cdiEdits `json:"containerEdits"`
}

type cdiEdits struct {
	Env []string `json:"env"`
}

func (d *driver) specPath(claim types.UID) string {
	return filepath.Join(d.cdiDir, fmt.Sprintf("weightsync-fake-gpu-%s.json", claim))
}

func (d *driver) PrepareResourceClaims(
	ctx context.Context, claims []*resourceapi.ResourceClaim,
) (map[types.UID]kubeletplugin.PrepareResult, error) {
	results := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		results[claim.UID] = d.prepare(claim)
	}
	return results, nil
}

func (d *driver) prepare(claim *resourceapi.ResourceClaim) kubeletplugin.PrepareResult {
	if claim.Status.Allocation == nil {
		return kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s is not allocated", claim.Name)}
	}
	spec := cdiSpec{Version: "0.6.0", Kind: cdiKind}
	var prepared []kubeletplugin.Device
	for _, result := range claim.Status.Allocation.Devices.Results {
		if result.Driver != driverName {
			continue
		}
		var index int
		if _, err := fmt.Sscanf(result.Device, "gpu-%d", &index); err != nil {
			return kubeletplugin.PrepareResult{Err: fmt.Errorf("device %q is not one of ours", result.Device)}
		}
		name := fmt.Sprintf("%s-%s", claim.UID, result.Device)
		spec.Devices = append(spec.Devices, cdiDevice{
			Name:           name,
			ContainerEdits: cdiEdits{Env: []string{fmt.Sprintf("FAKE_GPU_%d=%s", index, uuid(d.node, index))}},
		})
		prepared = append(prepared, kubeletplugin.Device{
			Requests:     []string{result.Request},
			PoolName:     result.Pool,
			DeviceName:   result.Device,
			CDIDeviceIDs: []string{cdiKind + "=" + name},
		})
	}
	data, err := json.Marshal(spec)
	if err == nil {
		// Written whole then renamed: containerd watches the directory.
		tmp := d.specPath(claim.UID) + ".tmp"
		if err = os.WriteFile(tmp, data, 0o644); err == nil {
			err = os.Rename(tmp, d.specPath(claim.UID))
		}
	}
	if err != nil {
		return kubeletplugin.PrepareResult{Err: fmt.Errorf("writing the CDI spec: %w", err)}
	}
	klog.Infof("prepared claim %s/%s: %d device(s)", claim.Namespace, claim.Name, len(prepared))
	return kubeletplugin.PrepareResult{Devices: prepared}
}

func (d *driver) UnprepareResourceClaims(
	ctx context.Context, claims []kubeletplugin.NamespacedObject,
) (map[types.UID]error, error) {
	results := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		err := os.Remove(d.specPath(claim.UID))
		if os.IsNotExist(err) {
			err = nil
		}
		results[claim.UID] = err
	}
	return results, nil
}

func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	klog.Errorf("%s: %v", msg, err)
}

func main() {
	var (
		kubeconfig = flag.String("kubeconfig", "", "the kubeconfig to publish ResourceSlices with")
		node       = flag.String("node-name", "", "the node this plugin serves")
		gpus       = flag.Int("gpus", 4, "fake GPUs on the node")
		registrar  = flag.String("registrar-dir", kubeletplugin.KubeletRegistryDir, "the kubelet's plugin registration directory")
		pluginDir  = flag.String("plugin-dir", "", "this plugin's socket directory (default: the kubelet's plugins dir/<driver>)")
		cdiDir     = flag.String("cdi-dir", "/var/run/cdi", "where containerd reads CDI specs")
	)
	klog.InitFlags(nil)
	flag.Parse()
	if *node == "" {
		klog.Fatal("--node-name is required")
	}
	if *pluginDir == "" {
		*pluginDir = filepath.Join(kubeletplugin.KubeletPluginsDir, driverName)
	}
	for _, dir := range []string{*pluginDir, *cdiDir, *registrar} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			klog.Fatalf("creating %s: %v", dir, err)
		}
	}
	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		klog.Fatalf("kubeconfig: %v", err)
	}
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		klog.Fatalf("client: %v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	plugin := &driver{node: *node, cdiDir: *cdiDir}
	helper, err := kubeletplugin.Start(ctx, plugin,
		kubeletplugin.DriverName(driverName),
		kubeletplugin.NodeName(*node),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(*registrar),
		// Short: a Unix socket's path has at most 107 bytes, and the kubelet's root
		// directory may be deep already.
		kubeletplugin.RegistrarSocketFilename("gpu-reg.sock"),
		kubeletplugin.PluginDataDirectoryPath(*pluginDir),
	)
	if err != nil {
		klog.Fatalf("starting the kubelet plugin: %v", err)
	}
	defer helper.Stop()
	devices := make([]resourceapi.Device, 0, *gpus)
	for index := 0; index < *gpus; index++ {
		id, number := uuid(*node, index), int64(index)
		devices = append(devices, resourceapi.Device{
			Name: fmt.Sprintf("gpu-%d", index),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"uuid":  {StringValue: &id},
				"index": {IntValue: &number},
			},
		})
	}
	resources := resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{*node: {Slices: []resourceslice.Slice{{Devices: devices}}}},
	}
	if err := helper.PublishResources(ctx, resources); err != nil {
		klog.Fatalf("publishing the ResourceSlice: %v", err)
	}
	klog.Infof("serving %d fake GPUs of node %s as driver %s", *gpus, *node, driverName)
	<-ctx.Done()
}
