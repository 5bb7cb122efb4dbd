"""gRPC server reflection on the router: a client with no .proto file and no generated code
(grpcio-reflection's client, as grpcurl does) lists the services and calls Generate."""

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)


def test_router_lists_its_services(stack):
    with grpc.insecure_channel(stack.router.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {
        "pdserve.v1.RouterService",
        "pdserve.v1.ModelInfoService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services


def test_generate_from_reflected_descriptors_alone(stack):
    with grpc.insecure_channel(stack.router.address) as channel:
        # A pool of its own: nothing from pdserve's generated code (which this process has
        # imported elsewhere) can stand in for what the server describes.
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        method = pool.FindServiceByName("pdserve.v1.RouterService").methods_by_name["Generate"]
        assert method.server_streaming and not method.client_streaming
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        request = json_format.ParseDict(
            {"prompt": "reflected", "sampling": {"maxTokens": 5, "ignoreEos": True}},
            request_class(),
        )
        call = channel.unary_stream(
            f"/{method.containing_service.full_name}/{method.name}",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        replies = [json_format.MessageToDict(r) for r in call(request, timeout=30)]
    assert sum(len(r.get("tokenIds", [])) for r in replies) == 5
    assert replies[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert replies[-1]["usage"] == {"promptTokens": len(b"reflected"), "completionTokens": 5}
