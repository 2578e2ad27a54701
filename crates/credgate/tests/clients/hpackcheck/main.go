// hpackcheck: Go's HPACK (golang.org/x/net/http2/hpack, the one grpc-go and the kubelet use)
// as an oracle for credgate's, in two modes.
//
//	hpackcheck huffman   prints, one per line in hex, the Huffman code of each byte 0..255,
//	                     then of the 256 bytes in a row
//	hpackcheck decode    reads hex header blocks, one per line, decodes them with one
//	                     decoder (a 4096-byte table) and prints each field as
//	                     "hex(name) hex(value) sensitive", a blank line after each block,
//	                     or "error: ..." for a block that does not decode
package main

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"os"

	"golang.org/x/net/http2/hpack"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: hpackcheck huffman|decode")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "huffman":
		for b := 0; b < 256; b++ {
			fmt.Println(hex.EncodeToString(hpack.AppendHuffmanString(nil, string([]byte{byte(b)}))))
		}
		all := make([]byte, 256)
		for b := range all {
			all[b] = byte(b)
		}
		fmt.Println(hex.EncodeToString(hpack.AppendHuffmanString(nil, string(all))))
	case "decode":
		dec := hpack.NewDecoder(4096, nil)
		in := bufio.NewScanner(os.Stdin)
		in.Buffer(make([]byte, 1<<20), 1<<24)
		for in.Scan() {
			block, err := hex.DecodeString(in.Text())
			if err != nil {
				fmt.Println("error: not hex")
				continue
			}
			fields, err := dec.DecodeFull(block)
			if err != nil {
				fmt.Println("error:", err)
				continue
			}
			for _, f := range fields {
				fmt.Printf("%s %s %t\n", hex.EncodeToString([]byte(f.Name)), hex.EncodeToString([]byte(f.Value)), f.Sensitive)
			}
			fmt.Println()
		}
	default:
		os.Exit(2)
	}
}
