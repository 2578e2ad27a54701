// A containerd remote snapshotter for the node rig: stargz-snapshotter's own service (the root
// module github.com/containerd/stargz-snapshotter at the version go.mod pins) served over
// containerd's snapshots gRPC API on a unix socket. Written here because the module holding
// stargz-snapshotter's own programs (.../cmd) is not served by the Go module proxy (issue 51;
// docs/snapshotters.md).
//
// Its FUSE servers run in this process, or with `[fuse_manager] enable = true` (and its `path`
// and `address`) in stargz's FUSE manager (the rig's stargz-fuse-manager), which this program
// starts when none runs and which outlives it: a restart of the snapshotter then leaves the
// running containers' filesystems served. Credentials come from its docker-config keychain,
// from its CRI keychain (the kubelet's image service pointed at this socket, or at the FUSE
// manager's `listen_path`; `[cri_keychain] enable_keychain` and `image_service_path` the
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

	"credgate.local/node-tools/stargz/imageforward"
	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/log"
	"github.com/containerd/stargz-snapshotter/fusemanager"
	"github.com/containerd/stargz-snapshotter/service"
	"github.com/containerd/stargz-snapshotter/service/keychain/keychainconfig"
	"github.com/containerd/stargz-snapshotter/snapshot"
	"github.com/pelletier/go-toml/v2"
	"google.golang.org/grpc"
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
	var manager managerConfig
	if configPath != "" {
		raw, err := os.ReadFile(configPath)
		if err != nil {
			return err
		}
		if err := toml.Unmarshal(raw, &config); err != nil {
			return fmt.Errorf("%s: %w", configPath, err)
		}
		if err := toml.Unmarshal(raw, &manager); err != nil {
			return fmt.Errorf("%s: %w", configPath, err)
		}
	}
	if err := service.Supported(root); err != nil {
		return fmt.Errorf("stargz cannot run here: %w", err)
	}
	rpc := grpc.NewServer()
	var sn snapshots.Snapshotter
	var err error
	if manager.FuseManager.Enable {
		sn, err = withFuseManager(ctx, root, &config, manager.FuseManager)
	} else {
		sn, err = inProcess(ctx, rpc, root, &config)
	}
	if err != nil {
		return err
	}
	if !manager.FuseManager.Enable {
		// Its FUSE servers end with this process: their mounts go with them. The FUSE manager's
		// outlive it (stopping the manager ends them).
		defer sn.Close()
	}
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

// The `[fuse_manager]` table of stargz-snapshotter's config.toml.
type managerConfig struct {
	FuseManager fuseManager `toml:"fuse_manager"`
}

type fuseManager struct {
	Enable  bool   `toml:"enable"`
	Address string `toml:"address"`
	Path    string `toml:"path"`
}

// inProcess is stargz's service with its FUSE servers in this process: its docker-config
// keychain (DOCKER_CONFIG's credential helpers) and, when enabled, its CRI keychain (stargz's
// image service on this socket, which keeps each pull's credential in memory and hands the call
// on through a pipe to the runtime's image service).
func inProcess(ctx context.Context, rpc *grpc.Server, root string, config *service.Config) (snapshots.Snapshotter, error) {
	keychain := config.CRIKeychainConfig
	creds, pipe, err := keychainconfig.ConfigKeychain(ctx, rpc, &keychainconfig.Config{
		EnableCRIKeychain: keychain.EnableKeychain,
	})
	if err != nil {
		return nil, err
	}
	if pipe != nil {
		if keychain.ImageServicePath == "" {
			return nil, fmt.Errorf("cri_keychain needs image_service_path")
		}
		stop, err := imageforward.Serve(pipe, keychain.ImageServicePath)
		if err != nil {
			return nil, err
		}
		go func() {
			<-ctx.Done()
			stop()
		}()
	}
	return service.NewStargzSnapshotterService(ctx, root, config, service.WithCredsFuncs(creds...))
}

// withFuseManager is stargz's snapshotter over its FUSE manager, started here when none runs
// (its socket absent). A manager that was already running still serves the mounts: nothing is
// restored then, as stargz's own program does.
func withFuseManager(ctx context.Context, root string, config *service.Config, fm fuseManager) (snapshots.Snapshotter, error) {
	if fm.Path == "" || !filepath.IsAbs(fm.Address) {
		return nil, fmt.Errorf("fuse_manager needs path and an absolute address")
	}
	started, err := fusemanager.StartFuseManager(ctx, fm.Path, fm.Address,
		filepath.Join(root, "fusestore.db"), "info", filepath.Join(root, "stargz-fuse-manager.log"), "")
	if err != nil {
		return nil, fmt.Errorf("starting the FUSE manager: %w", err)
	}
	fs, err := fusemanager.NewManagerClient(ctx, root, fm.Address, &fusemanager.Config{Config: *config})
	if err != nil {
		return nil, fmt.Errorf("configuring the FUSE manager: %w", err)
	}
	opts := []snapshot.Opt{snapshot.AsynchronousRemove}
	if !started {
		opts = append(opts, snapshot.NoRestore)
	}
	if config.AllowInvalidMountsOnRestart {
		opts = append(opts, snapshot.AllowInvalidMountsOnRestart)
	}
	return snapshot.NewSnapshotter(ctx, filepath.Join(root, "snapshotter"), fs, opts...)
}
