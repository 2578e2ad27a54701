// criclient drives an image service with k8s.io/cri-client, the kubelet's own CRI client,
// built and dialed as the kubelet builds and dials it (RemoteImageServiceBuilder: a
// connection timeout, the ImageFsInfo check at start, streaming lists when -streaming, with
// its fallback to ListImages on UNIMPLEMENTED). It prints one JSON line:
//
//	{"code": 0, "message": "", "result": ...}
//
// with the gRPC code and message of the error the client returned (code 2 for a plain
// error: cri-client strips UNKNOWN statuses to their message), and the call's result.
//
//	criclient -endpoint unix:///PATH [-streaming] pull IMAGE [-pod NS/NAME/UID] [-auth]
//	criclient -endpoint unix:///PATH [-streaming] status IMAGE | remove IMAGE | list
//
// -auth reads {"username": ..., "password": ...} from stdin (never a command line), as the
// kubelet passes a pull secret's credential in PullImage's auth.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	remote "k8s.io/cri-client/pkg"
)

type answer struct {
	Code    uint32      `json:"code"`
	Message string      `json:"message"`
	Result  interface{} `json:"result"`
}

type image struct {
	ID          string   `json:"id"`
	RepoTags    []string `json:"repo_tags"`
	RepoDigests []string `json:"repo_digests"`
	Pinned      bool     `json:"pinned"`
}

func main() {
	endpoint := flag.String("endpoint", "", "unix:///path of the image service")
	streaming := flag.Bool("streaming", false, "list images with StreamImages (KEP-5825)")
	timeout := flag.Duration("timeout", 2*time.Minute, "the connection timeout (and each call's)")
	flag.Parse()
	args := flag.Args()
	if *endpoint == "" || len(args) == 0 {
		fail(fmt.Errorf("usage: criclient -endpoint unix:///PATH [-streaming] pull|status|remove IMAGE | list"))
	}
	ctx := context.Background()
	service, err := remote.NewRemoteImageServiceBuilder().
		WithEndpoint(*endpoint).
		WithConnectionTimeout(*timeout).
		WithUseStreaming(*streaming).
		Build(ctx)
	if err != nil {
		fail(err)
	}
	defer service.Close(ctx)
	out := answer{}
	switch args[0] {
	case "pull":
		pull := flag.NewFlagSet("pull", flag.ExitOnError)
		pod := pull.String("pod", "", "NAMESPACE/NAME/UID of the pod the pull is for")
		withAuth := pull.Bool("auth", false, "read the credential from stdin")
		if len(args) < 2 {
			fail(fmt.Errorf("pull IMAGE"))
		}
		if err := pull.Parse(args[2:]); err != nil {
			fail(err)
		}
		var auth *runtimeapi.AuthConfig
		if *withAuth {
			body, err := io.ReadAll(io.LimitReader(os.Stdin, 1<<16))
			if err != nil {
				fail(err)
			}
			auth = &runtimeapi.AuthConfig{}
			if err := json.Unmarshal(body, auth); err != nil {
				fail(err)
			}
		}
		var sandbox *runtimeapi.PodSandboxConfig
		if *pod != "" {
			parts := strings.SplitN(*pod, "/", 3)
			if len(parts) != 3 {
				fail(fmt.Errorf("-pod NAMESPACE/NAME/UID"))
			}
			sandbox = &runtimeapi.PodSandboxConfig{Metadata: &runtimeapi.PodSandboxMetadata{
				Namespace: parts[0], Name: parts[1], Uid: parts[2]}}
		}
		ref, err := service.PullImage(ctx, &runtimeapi.ImageSpec{Image: args[1]}, auth, sandbox)
		out.Result = ref
		out.set(err)
	case "status":
		resp, err := service.ImageStatus(ctx, &runtimeapi.ImageSpec{Image: arg(args)}, false)
		if err == nil && resp.Image != nil {
			out.Result = of(resp.Image)
		}
		out.set(err)
	case "remove":
		out.set(service.RemoveImage(ctx, &runtimeapi.ImageSpec{Image: arg(args)}))
	case "list":
		images, err := service.ListImages(ctx, nil)
		list := []image{}
		for _, i := range images {
			list = append(list, of(i))
		}
		sort.Slice(list, func(a, b int) bool { return list[a].ID < list[b].ID })
		out.Result = list
		out.set(err)
	default:
		fail(fmt.Errorf("unknown command %q", args[0]))
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail(err)
	}
}

func arg(args []string) string {
	if len(args) < 2 {
		fail(fmt.Errorf("%s IMAGE", args[0]))
	}
	return args[1]
}

func of(i *runtimeapi.Image) image {
	tags := append([]string{}, i.RepoTags...)
	digests := append([]string{}, i.RepoDigests...)
	sort.Strings(tags)
	sort.Strings(digests)
	return image{ID: i.Id, RepoTags: tags, RepoDigests: digests, Pinned: i.Pinned}
}

func (a *answer) set(err error) {
	if err != nil {
		st := status.Convert(err)
		a.Code, a.Message = uint32(st.Code()), st.Message()
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "criclient:", err)
	os.Exit(2)
}
