// grpccall makes one gRPC call with grpc-go, dialing a unix socket the way the kubelet and
// crictl dial their runtime, and prints what came back as one JSON line:
//
//	{"code": 0, "message": "", "responses": ["<hex>", ...]}
//
// The request's bytes (an encoded protobuf message) are read from stdin and the responses are
// printed as hex: a codec of raw bytes stands in for generated stubs.
//
//	grpccall -socket PATH -dial path|localhost -method /pkg.Service/Method [-stream N] [-timeout S]
//
// -dial path: the target is the socket's path and a context dialer opens it, so :authority is
// the path (the kubelet and crictl up to 1.30). -dial localhost: the same, with the authority
// set to localhost (1.31 and later).
//
// Built at the grpc-go version ../go.mod pins (scripts/node-tools/build).
package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

type answer struct {
	Code      uint32   `json:"code"`
	Message   string   `json:"message"`
	Responses []string `json:"responses"`
}

func main() {
	socket := flag.String("socket", "", "the unix socket's path")
	dial := flag.String("dial", "path", "path or localhost")
	method := flag.String("method", "", "the full method name")
	stream := flag.Int("stream", 0, "a server-streaming call: read this many messages")
	timeout := flag.Float64("timeout", 60, "the call's deadline, in seconds")
	flag.Parse()
	request, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(err)
	}
	dialer := func(ctx context.Context, addr string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", addr)
	}
	// As k8s.io/cri-client dials: NewClient (no blocking dial: the call connects), the
	// passthrough resolver so the socket's path reaches the dialer as it is.
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(dialer)}
	switch *dial {
	case "path":
	case "localhost":
		opts = append(opts, grpc.WithAuthority("localhost"))
	default:
		fail(fmt.Errorf("-dial: path or localhost, not %q", *dial))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(*timeout*float64(time.Second)))
	defer cancel()
	conn, err := grpc.NewClient("passthrough:///"+*socket, opts...)
	if err != nil {
		fail(err)
	}
	defer conn.Close()
	out := answer{Responses: []string{}}
	codec := grpc.ForceCodec(rawCodec{})
	if *stream == 0 {
		var response []byte
		err = conn.Invoke(ctx, *method, &request, &response, codec)
		if err == nil {
			out.Responses = append(out.Responses, hex.EncodeToString(response))
		}
	} else {
		desc := &grpc.StreamDesc{ServerStreams: true}
		var s grpc.ClientStream
		s, err = conn.NewStream(ctx, desc, *method, codec)
		if err == nil {
			err = s.SendMsg(&request)
		}
		if err == nil {
			err = s.CloseSend()
		}
		for err == nil && len(out.Responses) < *stream {
			var response []byte
			if err = s.RecvMsg(&response); err == nil {
				out.Responses = append(out.Responses, hex.EncodeToString(response))
			}
		}
		if err == io.EOF {
			err = nil
		}
	}
	if err != nil {
		st := status.Convert(err)
		out.Code, out.Message = uint32(st.Code()), st.Message()
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "grpccall:", err)
	os.Exit(2)
}
