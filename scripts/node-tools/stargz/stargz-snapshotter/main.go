// A containerd remote snapshotter for the node rig: stargz-snapshotter's own service (the root
// module github.com/containerd/stargz-snapshotter at the version go.mod pins) served over
// containerd's snapshots gRPC API on a unix socket. Written here because the module holding stargz-snapshotter's own
// programs (.../cmd) is not served by the Go module proxy (issue 51; docs/snapshotters.md).
// Credentials come from its docker-config keychain, from its CRI keychain (the kubelet's image
// service pointed at this socket, `[cri_keychain] enable_keychain` and `image_service_path` the
// runtime's socket, as stargz-snapshotter's docs configure it), or from none when it reads
// through credgate's registry mirror.
//
//	stargz-snapshotter -address SOCKET -root DIR -config FILE.toml
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/log"
	"github.com/containerd/stargz-snapshotter/service"
	"github.com/containerd/stargz-snapshotter/service/keychain/keychainconfig"
	"github.com/pelletier/go-toml/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtime "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func main() {
	address := flag.String("address", "", "the socket to serve on")
	root := flag.String("root", "", "the snapshotter's state directory")
	configPath := flag.String("config", "", "stargz-snapshotter's config.toml")
	flag.Parse()
	if *address == "" || *root == "" {
		fmt.Fprintln(os.Stderr, "usage: stargz-snapshotter -address SOCKET -root DIR [-config FILE]")
		os.Exit(2)
	}
	if err := run(*address, *root, *configPath); err != nil {
		log.L.WithError(err).Error("stargz snapshotter stopped")
		os.Exit(1)
	}
}

func run(address, root, configPath string) error {
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	var config service.Config
	if configPath != "" {
		raw, err := os.ReadFile(configPath)
		if err != nil {
			return err
		}
		if err := toml.Unmarshal(raw, &config); err != nil {
			return fmt.Errorf("%s: %w", configPath, err)
		}
	}
	if err := service.Supported(root); err != nil {
		return fmt.Errorf("stargz cannot run here: %w", err)
	}
	// Its docker-config keychain (DOCKER_CONFIG's credential helpers) and, when enabled, its
	// CRI keychain: stargz's image service on this socket, which keeps each pull's credential
	// in memory and hands the call on through a pipe, served here by a plain forwarder to the
	// runtime's image service.
	rpc := grpc.NewServer()
	keychain := config.CRIKeychainConfig
	creds, pipe, err := keychainconfig.ConfigKeychain(ctx, rpc, &keychainconfig.Config{
		EnableCRIKeychain: keychain.EnableKeychain,
	})
	if err != nil {
		return err
	}
	if pipe != nil {
		if keychain.ImageServicePath == "" {
			return fmt.Errorf("%s: cri_keychain needs image_service_path", configPath)
		}
		conn, err := grpc.NewClient("unix://"+keychain.ImageServicePath,
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer conn.Close()
		backend := grpc.NewServer()
		runtime.RegisterImageServiceServer(backend, forward{to: runtime.NewImageServiceClient(conn)})
		go func() { _ = backend.Serve(pipe) }()
		defer backend.Stop()
	}
	sn, err := service.NewStargzSnapshotterService(ctx, root, &config, service.WithCredsFuncs(creds...))
	if err != nil {
		return err
	}
	defer sn.Close()
	snapshotsapi.RegisterSnapshotsServer(rpc, snapshotservice.FromSnapshotter(sn))
	if err := os.MkdirAll(filepath.Dir(address), 0o700); err != nil {
		return err
	}
	_ = os.Remove(address)
	l, err := net.Listen("unix", address)
	if err != nil {
		return err
	}
	go func() {
		<-ctx.Done()
		rpc.Stop()
	}()
	return rpc.Serve(l)
}

// forward is the runtime's image service, unchanged: what stargz's CRI keychain hands each call
// on to.
type forward struct {
	runtime.UnimplementedImageServiceServer
	to runtime.ImageServiceClient
}

func (f forward) ListImages(ctx context.Context, r *runtime.ListImagesRequest) (*runtime.ListImagesResponse, error) {
	return f.to.ListImages(ctx, r)
}

func (f forward) ImageStatus(ctx context.Context, r *runtime.ImageStatusRequest) (*runtime.ImageStatusResponse, error) {
	return f.to.ImageStatus(ctx, r)
}

func (f forward) PullImage(ctx context.Context, r *runtime.PullImageRequest) (*runtime.PullImageResponse, error) {
	return f.to.PullImage(ctx, r)
}

func (f forward) RemoveImage(ctx context.Context, r *runtime.RemoveImageRequest) (*runtime.RemoveImageResponse, error) {
	return f.to.RemoveImage(ctx, r)
}

func (f forward) ImageFsInfo(ctx context.Context, r *runtime.ImageFsInfoRequest) (*runtime.ImageFsInfoResponse, error) {
	return f.to.ImageFsInfo(ctx, r)
}
