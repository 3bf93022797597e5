"""Which replica serves a request: a Ray Serve request router (it runs in the front's process, in the
DeploymentHandle that calls the replicas; Ray Serve LLM's PrefixCacheAffinityRouter is the model).

prefix_aware: the replica holding the longest run of the prompt's leading blocks (prefix_index.py)
gets it, so a conversation's turns, a shared system prompt or a RAG template stay where their KV
blocks are cached; with no match the least loaded replica gets it (ties: the one holding the fewest
blocks, so new prefixes spread). Only replicas within `imbalance` requests in flight of the idlest
are candidates: a busier one's affinity gives way (`balance`) to the best match among the others.
round_robin: in turn.

Every decision is written on the request's RouteTicket (the front puts it in response headers and
metrics). A ticket may pin a replica (a stored response lives on the replica that made it).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from ray.serve._private.request_router.request_router import RequestRouter

from twostep.entrypoints.replicas.prefix_index import Match, PrefixIndex, block_hashes

logger = logging.getLogger(__name__)

PREFIX, LEAST_LOADED, BALANCE, ROUND_ROBIN, PINNED = "prefix", "least_loaded", "balance", "round_robin", "pinned"
OVERFLOW = "overflow"        # the chosen replica was full: Ray sent it to the next one


@dataclass(slots=True)
class RouteTicket:
    """A request's routing: what the front knows (text, pin) and what the router decided."""

    text: str = ""
    pin: str | None = None
    replica: str | None = None
    decision: str = ""
    match: Match = Match(0, 0)
    _hashes: list[bytes] | None = field(default=None, repr=False)

    @property
    def hashes(self) -> list[bytes]:
        if self._hashes is None:
            self._hashes = block_hashes(self.text)
        return self._hashes

    def __reduce__(self):
        """The replica receives an empty ticket: the text is the router's, not the replica's."""
        return RouteTicket, ()


class TwostepRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix_aware", imbalance: int = 4) -> None:
        self.policy, self.imbalance = policy, imbalance
        self.index = PrefixIndex()
        self.ongoing: Counter[str] = Counter()
        self.turn = 0
        self.known: set[str] = set()
        self.assigned: dict[str, str] = {}      # Ray's request id -> the replica it went to

    # ---- Ray Serve's hooks ------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ticket = pending_request.args[0] if pending_request is not None and pending_request.args else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = sorted(by_id, key=lambda rid: (self.ongoing[rid], self.index.size(rid), rid))
        if not isinstance(ticket, RouteTicket) or not ranked:
            return [[by_id[rid] for rid in ranked]]
        chosen = self.choose(ticket, ranked)
        request_id = pending_request.metadata.internal_request_id
        if request_id not in self.assigned:      # a request cancelled before it was sent is no load
            pending_request.future.add_done_callback(
                lambda f: self._release(request_id, None) if f.cancelled() else None)
        self._assign(request_id, chosen, ticket)
        pending_request.routing_context.should_backoff = True   # all full: Ray waits before asking again
        return [[by_id[chosen]], [by_id[rid] for rid in ranked if rid != chosen]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        """Sent where Ray could: the chosen replica, or the next rank when the chosen one was full."""
        ticket = pending_request.args[0] if pending_request.args else None
        rid = replica_id.unique_id
        if isinstance(ticket, RouteTicket) and ticket.replica != rid:
            ticket.replica, ticket.match = rid, self.index.match(rid, ticket.hashes)
            ticket.decision = ticket.decision if ticket.decision == PINNED else OVERFLOW
            self._assign(pending_request.metadata.internal_request_id, rid, ticket)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """Only for the replica a request is counted on: not a broadcast's (never assigned), not an
        attempt that a retry moved elsewhere."""
        self._release(internal_request_id, replica_id.unique_id)

    def _release(self, request_id: str, rid: str | None) -> None:
        counted = self.assigned.get(request_id)
        if counted is not None and rid in (None, counted):
            del self.assigned[request_id]
            self.ongoing[counted] = max(0, self.ongoing[counted] - 1)

    def _assign(self, request_id: str, rid: str, ticket: RouteTicket) -> None:
        """Counted as in flight on rid from the moment it is chosen (a burst of requests is chosen
        before any reaches a replica), and its blocks held there."""
        previous = self.assigned.get(request_id)
        if previous is not None:
            self.ongoing[previous] = max(0, self.ongoing[previous] - 1)
        self.assigned[request_id] = rid
        self.ongoing[rid] += 1
        if ticket.pin is None:
            self.index.insert(rid, ticket.hashes)

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id.unique_id for r in replicas}
        for gone in self.known - ids:       # stopped or replaced: their caches went with them
            self.index.forget(gone)
            self.ongoing.pop(gone, None)
        self.known = ids

    def on_replica_actor_died(self, replica_id) -> None:
        logger.warning("replica %s died: no more requests go to it", replica_id.unique_id)
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)

    # ---- the policy --------------------------------------------------------------------------------

    def choose(self, ticket: RouteTicket, ranked: list[str]) -> str:
        """ranked: the live replicas, least loaded first. Writes the decision on the ticket."""
        if ticket.pin is not None and ticket.pin in ranked:
            return self._decide(ticket, ticket.pin, PINNED)
        if self.policy == "round_robin":
            self.turn += 1
            return self._decide(ticket, sorted(ranked)[self.turn % len(ranked)], ROUND_ROBIN)
        least = ranked[0]
        if not ticket.hashes:
            return self._decide(ticket, least, LEAST_LOADED)
        matches = {rid: self.index.match(rid, ticket.hashes).blocks for rid in ranked}
        # replicas within `imbalance` requests of the idlest; ranked order breaks ties: less loaded
        eligible = [rid for rid in ranked if self.ongoing[rid] - self.ongoing[least] <= self.imbalance]
        best, top = max(eligible, key=lambda rid: matches[rid]), max(matches.values())
        if top == 0:
            return self._decide(ticket, least, LEAST_LOADED)
        return self._decide(ticket, best, PREFIX if matches[best] == top else BALANCE)

    def _decide(self, ticket: RouteTicket, rid: str, decision: str) -> str:
        ticket.replica, ticket.decision, ticket.match = rid, decision, self.index.match(rid, ticket.hashes)
        return rid
