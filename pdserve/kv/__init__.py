"""Moving a prompt's KV cache from prefill to decode.

wire: the chunk format and its checks (no transport, no protobuf). sink: what prefill writes to.
receiver and leases: what decode accepts through. frames: the chunk as a PushKvRequest message.
grpc_transport, tcp_transport, inproc: the transports, each an adapter around sink and receiver.
"""
