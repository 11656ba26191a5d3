"""Fair shares of the relay: who may have a stream now (docs/architecture.md §12).

Two kinds of bound, both kept on the relay's event loop (no lock: only the loop touches
them):

- **In flight** (open on a tunnel, or waiting for a slot): at most ``total`` requests, at
  most ``per_key`` of one API key and ``per_deployment`` of one deployment. Past any of
  them the request is refused at once (503 STREAM_LIMIT, naming the bound), so one key or
  one deployment never takes every place.
- **A node's slots.** A tunnel carries at most ``MAX_STREAMS_PER_TUNNEL`` streams, and one
  key at most ``per_key_on_node`` of them, so another key's request finds a slot at once.
  A request beyond them waits for a slot (its head deadline runs meanwhile); a slot that
  frees goes to the waiting keys in turn, not to whoever asked most.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from modelforge_contract import tunnel as wire

SLOTS_PER_NODE = wire.MAX_STREAMS_PER_TUNNEL
# What one key may hold of a node's slots: a quarter stays for the others.
SLOTS_PER_KEY_ON_NODE = SLOTS_PER_NODE - SLOTS_PER_NODE // 4


class Refused(Exception):
    """The request is past one of the in-flight bounds; ``bound`` names it."""

    def __init__(self, bound: str, limit: int) -> None:
        super().__init__(f"{bound} ({limit})")
        self.bound, self.limit = bound, limit


@dataclass
class Ticket:
    """One request's place in flight, and the node slot it holds (if any)."""

    key: str
    deployment: str
    node: str | None = None
    left: bool = False


@dataclass
class _Node:
    held: collections.Counter[str] = field(default_factory=collections.Counter)
    # key -> the requests of that key waiting for a slot, in arrival order
    waiting: dict[str, collections.deque[tuple[Ticket, asyncio.Future[bool]]]] = field(
        default_factory=dict
    )

    @property
    def used(self) -> int:
        return sum(self.held.values())


class Shares:
    def __init__(
        self,
        total: int,
        per_key: int,
        per_deployment: int,
        slots_per_node: int = SLOTS_PER_NODE,
        per_key_on_node: int = SLOTS_PER_KEY_ON_NODE,
    ) -> None:
        self.total, self.per_key, self.per_deployment = total, per_key, per_deployment
        self.slots_per_node, self.per_key_on_node = slots_per_node, per_key_on_node
        self.in_flight = 0
        self.by_key: collections.Counter[str] = collections.Counter()
        self.by_deployment: collections.Counter[str] = collections.Counter()
        self._nodes: dict[str, _Node] = {}

    def admit(self, key: str, deployment: str) -> Ticket:
        """A place in flight for a request of ``key`` to ``deployment``; Refused past a
        bound. Give it back with ``leave``."""
        if self.in_flight >= self.total:
            raise Refused("the relay's requests in flight (MODELFORGE_RELAY_STREAMS)", self.total)
        if self.by_key[key] >= self.per_key:
            raise Refused(
                "this API key's requests in flight (MODELFORGE_RELAY_STREAMS_PER_KEY)",
                self.per_key,
            )
        if self.by_deployment[deployment] >= self.per_deployment:
            raise Refused(
                "this deployment's requests in flight (MODELFORGE_RELAY_STREAMS_PER_DEPLOYMENT)",
                self.per_deployment,
            )
        self.in_flight += 1
        self.by_key[key] += 1
        self.by_deployment[deployment] += 1
        return Ticket(key, deployment)

    def leave(self, ticket: Ticket) -> None:
        """The request is done: its slot and its place go back (once)."""
        if ticket.left:
            return
        ticket.left = True
        self.release(ticket)
        self.in_flight -= 1
        _drop(self.by_key, ticket.key)
        _drop(self.by_deployment, ticket.deployment)

    def _may_take(self, node: _Node, key: str) -> bool:
        return node.used < self.slots_per_node and node.held[key] < self.per_key_on_node

    def take_slot(self, ticket: Ticket, node_id: str) -> bool:
        """A slot on ``node_id``'s tunnel for the request if one is free now and nobody of
        its key waits for one there (False: wait with ``slot``)."""
        self.release(ticket)
        node = self._nodes.setdefault(node_id, _Node())
        if not node.waiting.get(ticket.key) and self._may_take(node, ticket.key):
            node.held[ticket.key] += 1
            ticket.node = node_id
            return True
        return False

    async def slot(self, ticket: Ticket, node_id: str, timeout: float) -> bool:
        """A slot on ``node_id``'s tunnel for the request, waiting for one in turn at most
        ``timeout`` seconds (False: none came). Not ``asyncio.wait_for``: before CPython
        3.12 it can swallow a cancellation that comes as the slot is granted, and a client
        that left would keep its request."""
        if self.take_slot(ticket, node_id):
            return True
        node = self._nodes[node_id]
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        queue = node.waiting.setdefault(ticket.key, collections.deque())
        queue.append((ticket, future))
        timer = loop.call_later(max(timeout, 0.0), _settle, future, False)
        try:
            granted = await future  # _hand_on sets ticket.node before it wakes us
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.result():
                self.release(ticket)  # granted as we were cancelled: give it back
            else:
                _unqueue(self._nodes.get(node_id), ticket)
            raise
        finally:
            timer.cancel()
        if not granted:
            _unqueue(self._nodes.get(node_id), ticket)
        return granted

    def release(self, ticket: Ticket) -> None:
        """The request's node slot goes back (to the next key waiting on that node)."""
        node_id, ticket.node = ticket.node, None
        if node_id is None:
            return
        node = self._nodes[node_id]
        _drop(node.held, ticket.key)
        self._hand_on(node_id, node)

    def _hand_on(self, node_id: str, node: _Node) -> None:
        """Give free slots to waiting requests, one key after another (the key that
        waited longest first, then it goes to the back)."""
        progress = True
        while progress and node.used < self.slots_per_node and node.waiting:
            progress = False
            for key in list(node.waiting):
                if node.used >= self.slots_per_node:
                    break
                if not self._may_take(node, key):
                    continue
                queue = node.waiting.pop(key)  # re-added at the back: the next key's turn
                while queue:
                    ticket, future = queue.popleft()
                    if not future.done():  # not one cancelled or timed out meanwhile
                        node.held[key] += 1
                        ticket.node = node_id
                        future.set_result(True)
                        progress = True
                        break
                if queue:
                    node.waiting[key] = queue
        if not node.held and not node.waiting:
            del self._nodes[node_id]

    def waiting(self) -> int:
        return sum(len(q) for node in self._nodes.values() for q in node.waiting.values())


def _drop(counter: collections.Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


def _unqueue(node: _Node | None, ticket: Ticket) -> None:
    if node is None:
        return
    queue = node.waiting.get(ticket.key)
    if queue is None:
        return
    for entry in list(queue):
        if entry[0] is ticket:
            queue.remove(entry)
    if not queue:
        del node.waiting[ticket.key]
