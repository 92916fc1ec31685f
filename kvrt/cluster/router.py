"""Ray Serve's request router for kvrt replicas: a request's :class:`kvrt.cluster.affinity.Route` picks its replica.

Ray Serve calls :meth:`AffinityRouter.choose_replicas` with the live replicas and the pending request; the
ingress passes the route as the ``route`` keyword of its call (``forward(..., route=...)``). The answer is
ranks of replicas, best first; Ray sends the request to the least loaded replica of the first rank that has
room (a replica has room below its ``max_ongoing_requests``) and backs off and retries while none has:
- a pinned route (an agent): one rank, its rendezvous winner, so the agent waits for its own replica;
- a keyed route (a prompt's opening): its winner, then all the others;
- no key: all replicas in one rank, so the least loaded takes it.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvrt.cluster.affinity import Route, ranked

ROUTE_KWARG = "route"


class AffinityRouter(RequestRouter):  # type: ignore[misc]  # Ray's classes are untyped (Any) for mypy
    """Agent and prefix affinity over the live replicas (see the module docstring)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # each pass over the ranks counts as a try: Ray waits (backoff) before the next, rather than spinning
        pending_request.routing_context.should_backoff = True
        route = pending_request.kwargs.get(ROUTE_KWARG)
        if not isinstance(route, Route) or route.key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        order = [by_id[replica_id] for replica_id in ranked(route.key, list(by_id))]
        return [order[:1]] if route.pinned else [order[:1], order[1:]]
