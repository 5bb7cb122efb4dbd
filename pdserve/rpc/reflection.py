"""gRPC server reflection: clients (grpcurl, Postman, a Node or Go client) discover the contract
from the server itself, without the .proto file."""

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from pdserve.v1 import pdserve_pb2 as pb


def enable(server: grpc.aio.Server, *services: str) -> None:
    """Reflects `services` (short names in pdserve.v1, e.g. "RouterService"), plus the standard
    health service and reflection itself."""
    names = [pb.DESCRIPTOR.services_by_name[s].full_name for s in services]
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
