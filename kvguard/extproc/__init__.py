"""The Envoy external-processing protocol: the ext_proc stream (service.py), the answers it sends
(responses.py) and the gRPC server it runs on (server.py)."""
