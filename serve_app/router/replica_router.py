"""The request router of the engine deployments (Ray Serve's ``RequestRouter``), on every handle
to them: in the router replicas, and in any other caller (the tests' driver).

It does two things Serve's own power-of-two router does not:

* **Pinned calls.** pd-serve's schedule picks the engine (by its own load view, decode first); a
  call that names a replica (``replica=<Serve replica id>`` among its keyword arguments) goes to
  that replica and no other. Stats polls, ``inspect`` calls and the engine calls that go through
  Serve (every one with ``engine_transport: grpc`` or ``ray``; with ``http``, those made before
  the engine's own endpoint is known) are pinned this way. A pinned call whose replica is not
  running (it stopped meanwhile) waits in Serve's queue, as any call does while no replica can
  take it; the caller's own deadline ends it. Calls that name no replica are routed as Serve's
  default router does: the least loaded of two.
* **Membership.** Each list of running replicas Serve sends is published to the process's
  ``MEMBERSHIP`` (router/membership.py), where the router's engine pool learns of joins and
  leaves.
"""

from __future__ import annotations

import logging
import random
import uuid

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serve_app.router.membership import ReplicaInfo

logger = logging.getLogger("pd_serve.router")

PIN_KWARG = "replica"


def pinned_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica id a call names, if any."""
    if pending_request is None:
        return None
    pin = (pending_request.kwargs or {}).get(PIN_KWARG)
    return pin if isinstance(pin, str) else None


class EngineRequestRouter(RequestRouter):
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        infos = []
        for replica in replicas:
            info = ReplicaInfo.from_metadata(replica.replica_id.unique_id, replica.replica_metadata or {})
            if info is not None:
                infos.append(info)
        deployment = self._deployment_id
        # Imported here, not at module level: Serve ships this class to each handle by value
        # (cloudpickle), module globals included, so a global would be a copy of the registry,
        # not the one the router's pool reads.
        from serve_app.router.membership import MEMBERSHIP

        # Named once per request router (an id() could be a collected one's again).
        publisher = self.__dict__.setdefault("_pd_serve_publisher", uuid.uuid4().hex)
        MEMBERSHIP.publish(deployment.app_name, deployment.name, infos, publisher=publisher)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        pin = pinned_replica(pending_request)
        if pending_request is not None:
            # Every candidate is offered at once (no locality tiers): when none can take the call
            # (the pinned replica is gone, or all are full), Serve must back off before asking
            # again. Without this, its routing loop asks again at once, never yielding the event
            # loop: a pinned call to a replica that died would freeze the router replica.
            pending_request.routing_context.should_backoff = True

        if pin is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin]]
        if len(candidate_replicas) <= 2:
            return [candidate_replicas]
        return [random.sample(candidate_replicas, 2)]
