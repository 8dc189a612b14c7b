"""Fault injection into in-process service actors (real NATS, real sockets)."""


def engines_idle(stack) -> bool:
    """Every engine of the stack holds no sequence and no block."""
    engines = [s.engine for s in [stack.prefill, *stack.relays, *stack.mains]]
    return all(e.num_sequences == 0 and e.blocks.num_used_blocks == 0 for e in engines)


async def crash(service):
    """Kill a service actor without a goodbye: engine loop, heartbeats, bulk port and NATS gone."""
    await service.nc.close()  # first: a crashed process publishes nothing on its way out
    loop = getattr(service, "loop", None) or getattr(service, "_loop", None)
    if loop is not None:
        await loop.stop()
    for task in service._tasks:
        task.cancel()
    receiver = getattr(service, "receiver", None)
    if receiver is not None:
        await receiver.stop()


def lost_cancels() -> dict[str, float]:
    """Per engine service, the requests its lease freed as ``finished``: their router no longer
    ran them and no cancel had freed them (what tells an operator cancels go missing)."""
    from shared.metrics import LEASES_EXPIRED

    return {
        service: LEASES_EXPIRED.labels(service, "finished")._value.get()
        for service in ("prefill", "relay_decode", "main_decode")
    }
