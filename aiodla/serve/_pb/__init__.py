"""Generated protobuf messages of the KServe v2 gRPC protocol (``grpc_service.proto``)."""
