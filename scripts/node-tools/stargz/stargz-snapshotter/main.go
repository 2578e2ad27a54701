// A containerd remote snapshotter for the node rig: stargz-snapshotter's own service (the root
// module github.com/containerd/stargz-snapshotter at the version go.mod pins) served over
// containerd's snapshots gRPC API on a unix socket. Written here because the module holding stargz-snapshotter's own
// programs (.../cmd) is not served by the Go module proxy (issue 51; docs/snapshotters.md).
// Credentials come from its docker-config keychain, or from none when it reads through
// credgate's registry mirror.
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
	// Its docker-config keychain (DOCKER_CONFIG's credential helpers). Its CRI keychain, which
	// v0.19 serves through containerd's own CRI plugin, is not offered by this program.
	if config.CRIKeychainConfig.EnableKeychain {
		return fmt.Errorf("%s: the CRI keychain is not served by this program", configPath)
	}
	rpc := grpc.NewServer()
	creds, _, err := keychainconfig.ConfigKeychain(ctx, rpc, &keychainconfig.Config{})
	if err != nil {
		return err
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
