"""What the services share at the gRPC edge: protobuf conversions and server bootstrap."""
