// The gRPC clients credgate's tests run against its sockets, at today's versions: grpc-go
// (grpccall: raw calls, dialing as the kubelet does), Go's HPACK (hpackcheck) and the kubelet's
// own CRI client, k8s.io/cri-client (criclient). Built by scripts/node-tools/build into a cache
// outside the repository, keyed by this file, go.sum and the programs' sources.
module credgate.local/test-clients

go 1.26.6

require (
	golang.org/x/net v0.62.0
	google.golang.org/grpc v1.85.0
	k8s.io/cri-api v0.37.2
	k8s.io/cri-client v0.37.2
)

require (
	github.com/Microsoft/go-winio v0.6.2 // indirect
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/go-logr/logr v1.4.4 // indirect
	github.com/go-logr/stdr v1.2.2 // indirect
	go.opentelemetry.io/auto/sdk v1.2.1 // indirect
	go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc v0.68.0 // indirect
	go.opentelemetry.io/otel v1.45.0 // indirect
	go.opentelemetry.io/otel/metric v1.45.0 // indirect
	go.opentelemetry.io/otel/trace v1.45.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
	golang.org/x/text v0.43.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
	k8s.io/component-base v0.37.2 // indirect
	k8s.io/klog/v2 v2.140.0 // indirect
	k8s.io/utils v0.0.0-20260626114624-be93311217bd // indirect
)

tool (
	credgate.local/test-clients/criclient
	credgate.local/test-clients/grpccall
	credgate.local/test-clients/hpackcheck
)
