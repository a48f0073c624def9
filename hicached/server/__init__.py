"""The gRPC layer: the only package that imports grpc."""
