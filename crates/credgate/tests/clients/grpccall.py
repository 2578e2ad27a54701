"""One gRPC call with Python grpcio and its default channel options, printed as one JSON line:

    {"code": 0, "message": "", "responses": ["<hex>", ...]}

The request's bytes (an encoded protobuf message) come on stdin; responses are printed as hex
(no serializers: grpcio passes bytes through, so no generated stubs are needed).

    python3 grpccall.py SOCKET METHOD [--stream N] [--timeout S]

The channel is `grpc.insecure_channel("unix:" + SOCKET)`, as a user writes it: grpcio 1.57 and
later send the socket's percent-encoded path as :authority.
"""

import argparse
import json
import sys

import grpc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("method")
    parser.add_argument("--stream", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args()
    request = sys.stdin.buffer.read()
    out = {"code": 0, "message": "", "responses": []}
    with grpc.insecure_channel("unix:" + args.socket) as channel:
        try:
            if args.stream == 0:
                call = channel.unary_unary(args.method)
                out["responses"].append(call(request, timeout=args.timeout).hex())
            else:
                call = channel.unary_stream(args.method)(request, timeout=args.timeout)
                for response in call:
                    out["responses"].append(response.hex())
                    if len(out["responses"]) == args.stream:
                        call.cancel()
                        break
        except grpc.RpcError as e:
            out["code"], out["message"] = e.code().value[0], e.details() or ""
    print(json.dumps(out))


if __name__ == "__main__":
    main()
