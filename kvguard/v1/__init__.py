"""kvguard's own gRPC API (proto/kvguard/v1), generated here by `make` with grpcio-tools."""
