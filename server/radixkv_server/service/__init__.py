"""The gRPC shell around the core: sessions, namespaces, acks, errors, the server."""
