// Package imageforward serves, on the listener stargz's CRI keychain hands its calls on to, the
// runtime's image service unchanged: the backend the keychain needs in the rig's stargz
// snapshotter and in its FUSE manager alike.
package imageforward

import (
	"context"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtime "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Serve forwards every image call arriving on pipe to the image service on the unix socket
// runtimeSocket, until the returned stop is called.
func Serve(pipe net.Listener, runtimeSocket string) (stop func(), err error) {
	conn, err := grpc.NewClient("unix://"+runtimeSocket,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	backend := grpc.NewServer()
	runtime.RegisterImageServiceServer(backend, forward{to: runtime.NewImageServiceClient(conn)})
	go func() { _ = backend.Serve(pipe) }()
	return func() {
		backend.Stop()
		_ = conn.Close()
	}, nil
}

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
