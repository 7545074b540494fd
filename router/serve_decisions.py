"""Ray adapter for routers sharing their decisions (``router.shared_decisions``).

One :class:`DecisionBoard` actor per Worker deployment holds the shared
:class:`DecisionLog`. Each request router (one per Ingress replica) runs a
:class:`DecisionExchange` on its own event loop: every ``period_s`` it sends
the decisions it made since its last exchange and books the others' in its
policy (``on_peer_routed``). A router that has heard no other router for
``IDLE_AFTER_S`` exchanges every ``IDLE_PERIOD_S`` only (a lone Ingress
costs one small call a second); a second router is heard within that and
both go back to ``period_s``. The board is created on first use
(``get_if_exists``) and owned by the replica that created it: if that
replica dies the board dies with it, the next exchange recreates it, and
the routers meanwhile route on what they see themselves, as without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import ray

from router.shared_decisions import DecisionLog, PeerDecision

logger = logging.getLogger("router.serve")

NAMESPACE = "kvroute"
IDLE_PERIOD_S = 1.0
IDLE_AFTER_S = 5.0
WARN_EVERY_S = 60.0


@ray.remote(num_cpus=0, max_restarts=0)
class DecisionBoard:
    def __init__(self, max_events: int = 8192) -> None:
        self._log = DecisionLog(max_events)

    def exchange(self, router_id: str, events: list, since: int | None) -> tuple[list, int]:
        return self._log.exchange(router_id, events, since, time.monotonic())


def board_name(app_name: str, deployment: str) -> str:
    return f"kvroute-decisions::{app_name}::{deployment}"


def get_decision_board(app_name: str, deployment: str) -> ray.actor.ActorHandle:
    """The deployment's board, created if missing."""
    return DecisionBoard.options(name=board_name(app_name, deployment), namespace=NAMESPACE,
                                 get_if_exists=True).remote()


class DecisionExchange:
    """One router's side of the board: :meth:`post` queues a decision it made;
    :meth:`run` (a task on the router's loop, where the policy is changed)
    exchanges them for the others' every period."""

    def __init__(self, policy, app_name: str, deployment: str, period_s: float, block_size: int) -> None:
        self._policy, self._app_name, self._deployment = policy, app_name, deployment
        self._period_s, self._block_size = period_s, block_size
        self.router_id = uuid.uuid4().hex
        self._outbox: list[tuple] = []  # PeerDecision.to_wire() of the decisions since the last exchange
        self._since: int | None = None
        self._board = None
        self._heard_s = -float("inf")  # when another router's decision last arrived
        self._warned_s = -float("inf")
        self.num_sent = self.num_booked = 0

    def post(self, request: object, replica_id: str) -> None:
        decision = PeerDecision.of(request, replica_id, self._block_size)
        if decision is not None:
            self._outbox.append(decision.to_wire())

    async def run(self) -> None:
        while True:
            await self.exchange()
            idle = time.monotonic() - self._heard_s > IDLE_AFTER_S
            await asyncio.sleep(IDLE_PERIOD_S if idle else self._period_s)

    async def exchange(self) -> None:
        """One exchange; a failure drops this period's decisions (the others
        just learn less) and recreates the board next time."""
        outbox, self._outbox = self._outbox, []
        try:
            if self._board is None:
                self._board = get_decision_board(self._app_name, self._deployment)
            events, self._since = await self._board.exchange.remote(self.router_id, outbox, self._since)
        except Exception as error:  # noqa: BLE001 - the board died with its replica, or Ray refused the call
            self._board = None
            now = time.monotonic()
            if now - self._warned_s > WARN_EVERY_S:
                self._warned_s = now
                logger.warning("shared decisions: exchange failed (%s); routing on this router's own view", error)
            return
        self.num_sent += len(outbox)
        if events:
            self._heard_s = time.monotonic()
        for wire in events:
            decision = PeerDecision.from_wire(wire)
            self._policy.on_peer_routed(decision.request, decision.replica_id, decision.tail_token_ids)
        self.num_booked += len(events)
