"""Why a Ray actor died, in a few words for the console lines of ``runtime.restarts``.

Owns reading Ray's ``RayActorError`` messages (Ray 2.60's wording) only; the scheduler
(``runtime.ray_scheduler``) and the rank hosts (``runtime.ray_ranks``) decide what a death means.
"""

from __future__ import annotations

from ray.exceptions import ActorUnavailableError, RayActorError


def exit_cause(exc: RayActorError) -> str:
    """Why an actor died, in a few words from Ray's error: ``killed by `ray.kill```, or
    ``worker process died (SYSTEM_ERROR: Worker unexpectedly exits ...)`` for a killed or
    crashed process (the last ``The actor is dead because ...`` of the message, without
    Ray's advice); for an actor Ray restarts, ``unreachable: RpcError: ...``."""
    if isinstance(exc, ActorUnavailableError):  # a restartable actor's process gone: "The actor <id> is unavailable"
        why = str(exc).partition(" is unavailable: ")[2].split(". The task may or may not")[0]
        return f"unreachable: {why.removeprefix('The actor is temporarily unavailable: ')}"
    lines = [line.strip() for line in str(exc).splitlines()[1:] if line.strip() and not line.startswith("\t")]
    text = " ".join(lines).rpartition("The actor is dead because ")[2].split(". Some common causes")[0].rstrip(".")
    text = text.removeprefix("it was ")
    if " Worker exit type: " in text:
        kind, _, detail = text.split(" Worker exit type: ", 1)[1].partition(" Worker exit detail: ")
        text = f"worker process died ({kind}: {detail})" if detail else f"worker process died ({kind})"
    text = text or str(exc).splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."
