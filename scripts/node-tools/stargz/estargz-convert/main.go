// Converts an uncompressed layer tar into an eStargz blob (the lazily readable gzip layer
// stargz-snapshotter mounts), with the estargz package of github.com/containerd/stargz-snapshotter
// at the version go.mod pins, and prints the TOC digest and the uncompressed size its layer
// descriptor's annotations carry (issue 51's rig).
//
//	estargz-convert IN.tar OUT.blob
package main

import (
	"fmt"
	"io"
	"os"

	"github.com/containerd/stargz-snapshotter/estargz"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: estargz-convert IN.tar OUT.blob")
		os.Exit(2)
	}
	if err := convert(os.Args[1], os.Args[2]); err != nil {
		fmt.Fprintln(os.Stderr, "estargz-convert:", err)
		os.Exit(1)
	}
}

func convert(in, out string) error {
	f, err := os.Open(in)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	blob, err := estargz.Build(io.NewSectionReader(f, 0, st.Size()))
	if err != nil {
		return err
	}
	defer blob.Close()
	o, err := os.Create(out)
	if err != nil {
		return err
	}
	if _, err := io.Copy(o, blob); err != nil {
		o.Close()
		return err
	}
	if err := o.Close(); err != nil {
		return err
	}
	size, err := blob.UncompressedSize()
	if err != nil {
		return err
	}
	fmt.Println(blob.TOCDigest(), size)
	return nil
}
