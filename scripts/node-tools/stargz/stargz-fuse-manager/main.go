// stargz-snapshotter's FUSE manager for the node rig: the root module's fusemanager package,
// the process that serves the snapshotter's lazily fetched layers over FUSE so that they outlive
// a restart of the snapshotter (stargz-snapshotter's docs/overview.md, "Fuse Manager"). The
// snapshotter program starts it when its config.toml says `[fuse_manager] enable = true`.
// Written here for the reason stargz-snapshotter/main.go gives; what it adds to the package is
// the keychains the filesystem reads with: the docker config's, and the CRI keychain when
// `[cri_keychain] enable_keychain` (the kubelet's image service on its `listen_path`, each call
// handed on to `image_service_path`).
//
//	stargz-fuse-manager  (started by the snapshotter, with the package's own flags)
package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"

	"credgate.local/node-tools/stargz/imageforward"
	"github.com/containerd/stargz-snapshotter/fusemanager"
	"github.com/containerd/stargz-snapshotter/service"
	"github.com/containerd/stargz-snapshotter/service/keychain/keychainconfig"
	"google.golang.org/grpc"
)

func main() {
	fusemanager.RegisterConfigFunc(keychains)
	fusemanager.Run()
}

// The forwarder of the last configuration: each start of the snapshotter configures the FUSE
// manager again (the manager stops the CRI server it was given; the forwarder is stopped here).
var (
	previousMu sync.Mutex
	previous   func()
)

func keychains(cc *fusemanager.ConfigContext) ([]service.Option, error) {
	previousMu.Lock()
	defer previousMu.Unlock()
	if previous != nil {
		previous()
		previous = nil
	}
	keychain := cc.Config.Config.CRIKeychainConfig
	var cri *grpc.Server
	if keychain.EnableKeychain {
		if keychain.ListenPath == "" || keychain.ImageServicePath == "" {
			return nil, fmt.Errorf("cri_keychain needs listen_path and image_service_path with the FUSE manager")
		}
		cri = grpc.NewServer()
	}
	creds, pipe, err := keychainconfig.ConfigKeychain(cc.Ctx, cri, &keychainconfig.Config{
		EnableCRIKeychain: keychain.EnableKeychain,
	})
	if err != nil {
		return nil, err
	}
	if pipe != nil {
		stop, err := imageforward.Serve(pipe, keychain.ImageServicePath)
		if err != nil {
			return nil, err
		}
		if err := os.MkdirAll(filepath.Dir(keychain.ListenPath), 0o700); err != nil {
			stop()
			return nil, err
		}
		_ = os.Remove(keychain.ListenPath)
		l, err := net.Listen("unix", keychain.ListenPath)
		if err != nil {
			stop()
			return nil, err
		}
		go func() { _ = cri.Serve(l) }()
		cc.CRIServer = cri
		previous = stop
	}
	return []service.Option{service.WithCredsFuncs(creds...)}, nil
}
