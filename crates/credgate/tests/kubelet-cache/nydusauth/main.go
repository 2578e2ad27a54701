// nydusauth runs nydus-snapshotter's kubelet credential provider (pkg/auth) on a provider
// config and plugin directory, and asks it for each image reference on the command line in
// order, through one provider and so one cache: it prints "REF USERNAME", or "REF -" when it
// gives none. Passwords are never printed.
//
//	nydusauth CONFIG BIN_DIR REF...
package main

import (
	"fmt"
	"os"

	"github.com/containerd/nydus-snapshotter/pkg/auth"
)

func main() {
	if len(os.Args) < 4 {
		fmt.Fprintln(os.Stderr, "usage: nydusauth CONFIG BIN_DIR REF...")
		os.Exit(2)
	}
	provider, err := auth.NewKubeletProvider(os.Args[1], os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for _, ref := range os.Args[3:] {
		kc, err := provider.GetCredentials(&auth.AuthRequest{Ref: ref})
		if err != nil || kc == nil {
			fmt.Printf("%s -\n", ref)
			continue
		}
		fmt.Printf("%s %s\n", ref, kc.Username)
	}
}
