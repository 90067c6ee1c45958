"""The Envoy external-processing protocol layer: the only place that speaks gRPC."""
