"""Where a request's time to first token went: the phases that tile it, each measured by the
service that saw it (durations only, so no two services' clocks are compared)."""

from dataclasses import dataclass

from pdserve.v1 import pdserve_pb2 as pb


@dataclass(frozen=True)
class RoomWait:
    """Router-side, for the attempt that succeeded: from receiving the request to asking decode
    for room, then until the lease was granted, then until a place among the prefill instance's
    calls was free (--prefill-calls-per-instance)."""

    routing_seconds: float
    decode_room_seconds: float
    prefill_call_seconds: float = 0.0


def request_phases(
    ttft: float, room: RoomWait, reply: pb.PrefillResponse, finished: pb.DecodeFinished
) -> pb.RequestPhases:
    """The phases of `ttft` (proto/pdserve/v1: RequestPhases); relay is what the others leave.
    Prefill's parts come from its reply, and are 0 for a prompt prefilled on decode."""
    known = (
        room.routing_seconds,
        room.decode_room_seconds,
        room.prefill_call_seconds,
        reply.queue_seconds,
        reply.prefill_seconds,
        reply.handoff.exposed_seconds,
    )
    return pb.RequestPhases(
        routing_seconds=room.routing_seconds,
        decode_room_seconds=room.decode_room_seconds,
        prefill_call_seconds=room.prefill_call_seconds,
        prefill_queue_seconds=reply.queue_seconds,
        prefill_compute_seconds=reply.prefill_seconds,
        transfer_after_compute_seconds=reply.handoff.exposed_seconds,
        # Prefill's reply comes after decode's commit, so its parts may overlap the first
        # token's way back by a little: the rest is never shown below 0.
        relay_seconds=max(0.0, ttft - sum(known)),
        first_decode_step_seconds=finished.first_decode_step_seconds,
    )


def phase_items(phases: pb.RequestPhases) -> list[tuple[str, float]]:
    """(name, seconds) of each phase in the order they happen: "routing", "decode_room", ..."""
    return [
        (f.name.removesuffix("_seconds"), getattr(phases, f.name)) for f in phases.DESCRIPTOR.fields
    ]
