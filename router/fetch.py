"""A routing decision, and the fetch hint it may carry: fetch a cached prefix
from the replica that holds it instead of recomputing it (issue 13)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FetchHint:
    """The first choice may fetch the KV of the prompt's first ``num_tokens``
    tokens from ``owner`` instead of computing them.

    ``owner``: the replica id the router believes holds those tokens' blocks
    (its own decisions, corrected by the owner's summaries; it may have
    evicted them since). ``num_tokens``: a positive multiple of the router's
    block size, below the prompt's length (the last prompt token is always
    computed); or, in a within-block hint (:func:`within_block_hint`), the
    owner's full blocks plus the tokens of the next block it is known to
    share (an earlier prompt's partial last block went there). The hashes
    behind it are salted with the request's tenant, so the owner holds them
    under the same tenant: a hint never crosses namespaces.

    ``alternates``: other replicas the router also believes hold those
    tokens, least loaded first (``PolicyConfig.fetch_alternates``). The
    receiver asks them in turn when the owner answers that it no longer holds
    them or is gone: the router's index lags the replicas' evictions by up to
    a summary period (plus ``learned_grace_s`` for what it routed itself), so
    the first holder named may have evicted a prefix another still holds.

    A hint, not an order: the receiving worker fetches only if its estimated
    transfer (bytes from the KV geometry ÷ measured bandwidth) beats
    recomputing those tokens, and recomputes after a bounded wait if every
    replica named has evicted them, died or is slow. ``num_tokens`` is the
    depth the router knows of, not a limit: the receiver asks for as much of
    the prompt as the replica holds (a replica that generated a chat's last
    answer holds it, though no router learned those tokens).

    ``owner_computing``: by this router's own bookings, a request it sent to
    the owner is still computing those tokens there (``PendingBlocks``).
    The owner's export waits for its prefill in flight, so the receiver
    gives the fetch longer before it recomputes (the Worker's
    ``prefill_patience``): waiting keeps the prefix computed once.
    """

    owner: str
    num_tokens: int
    alternates: tuple[str, ...] = ()
    owner_computing: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.owner, str) or not self.owner:
            raise ValueError(f"owner must be a non-empty replica id, got {self.owner!r}")
        if type(self.num_tokens) is not int or self.num_tokens <= 0:
            raise ValueError(f"num_tokens must be a positive int, got {self.num_tokens!r}")
        if isinstance(self.alternates, list):
            object.__setattr__(self, "alternates", tuple(self.alternates))
        alternates = self.alternates
        if not isinstance(alternates, tuple) or not all(isinstance(a, str) and a for a in alternates):
            raise ValueError(f"alternates must be a tuple of non-empty replica ids, got {alternates!r}")
        if self.owner in alternates or len(set(alternates)) != len(alternates):
            raise ValueError(f"alternates must be distinct and other than the owner, got {self!r}")
        if not isinstance(self.owner_computing, bool):
            raise ValueError(f"owner_computing must be a bool, got {self.owner_computing!r}")

    @property
    def owners(self) -> tuple[str, ...]:
        """The replicas to ask, in order: the owner, then the alternates."""
        return (self.owner, *self.alternates)


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """What :meth:`PrefixAffinityPolicy.decide` answers.

    ``ranked``: replicas to try, best first (what ``rank()`` returns; empty
    only when there is no candidate). ``fetch``: for the first choice only.

    Invariants: ``fetch`` is None when fetch is disabled
    (``PolicyConfig.fetch_enabled``), when ``ranked`` is empty, or when the
    owner is the first choice. Otherwise ``fetch.owner`` (and each of
    ``fetch.alternates``, none of them the first choice) is a replica known
    to hold the prompt's first ``fetch.num_tokens`` tokens, and either
    those are more than ``fetch_min_tokens`` beyond what the first choice
    holds (a smaller difference is not worth a fetch), or the hint is a
    *backup* (``PolicyConfig.backup_fetch_hints``): the first choice is
    known to hold them too, or all but at most ``fetch_min_tokens`` of them,
    ``owner`` is another holder, and the hint only matters if the first
    choice evicted them since it last reported.
    """

    ranked: tuple[str, ...]
    fetch: FetchHint | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ranked, tuple):
            object.__setattr__(self, "ranked", tuple(self.ranked))
        if self.fetch is not None and (not self.ranked or self.ranked[0] in self.fetch.owners):
            raise ValueError(f"a fetch hint needs a first choice other than the replicas it names, got {self!r}")


CREDIT_SCOPES = ("never", "over_bound", "always")


class FetchPlan:
    """What a fetch could bring each candidate of one decision: the owner
    (:func:`fetchable_tokens`) and, per candidate, what it already holds.

    ``depths``: the candidates' known depths (blocks); ``depth_of``: the
    index's depth of any replica, for a holder the candidates list missed
    (one past ``max_affinity_candidates`` that joined as a ring node), so a
    replica is never credited or hinted for tokens it holds already.

    ``credit_scope`` (``PolicyConfig.fetch_credit_scope``): when fetchable
    tokens lower a non-owner's cost. ``"never"``: the score is the no-fetch
    score, the hint rides on whatever it chose; ``"over_bound"``: only while
    the owner is over the load bound (``is_over(owner, fetchable tokens)``:
    the request cannot stay there anyway, so the credit only picks which
    lighter replica takes it); ``"always"``: against any owner, however
    lightly loaded (a request leaves a home that could have taken it and
    makes a second copy).

    ``max_alternates`` (``PolicyConfig.fetch_alternates``): how many other
    candidates holding the hinted tokens a hint names besides its owner
    (:attr:`FetchHint.alternates`).

    ``computing`` (None: no holder does): whether a holder is still
    computing its copy of the prefix (a request this router sent there is
    prefilling it). Owners and alternates are named among the holders that
    have computed it first, then by load: a receiver asking a holder whose
    copy is still in the works waits for that prefill, and recomputes if
    it outlasts its patience, while another holder could export at once
    (simulated shared-prefix FIFO, workload seed 17, queued copies on: a
    request hinted to a fresh copy still queued at its new holder
    recomputed a whole system prompt)."""

    def __init__(self, depths: Mapping[str, int], depth_of: Callable[[str], int], block_size: int,
                 num_prompt_tokens: int, load_of: Callable[[str], float], min_tokens: int,
                 fetch_token_cost: float, credit_scope: str = "always",
                 is_over: Callable[[str, int], bool] | None = None, max_alternates: int = 0,
                 computing: Callable[[str], bool] | None = None) -> None:
        if credit_scope not in CREDIT_SCOPES or (credit_scope == "over_bound" and is_over is None):
            raise ValueError(f"credit_scope must be one of {CREDIT_SCOPES} (over_bound needs is_over), "
                             f"got {credit_scope!r}")
        self._num_fetchable = fetchable_num_tokens(depths, block_size, num_prompt_tokens)
        self._owner: str | None = None  # the deepest holder, looked up on first need
        self._depths, self._depth_of, self._load_of = depths, depth_of, load_of
        self._block_size, self._num_prompt_tokens = block_size, num_prompt_tokens
        self._min_tokens, self._fetch_token_cost = min_tokens, fetch_token_cost
        self._credit_scope, self._is_over = credit_scope, is_over
        self._max_alternates = max_alternates
        self._computing = computing
        self._credit_open: bool | None = None  # decided once per plan, on the first credit asked

    @property
    def fetchable(self) -> tuple[str, int] | None:
        """:func:`fetchable_tokens` of the plan's holders."""
        if not self._num_fetchable:
            return None
        if self._owner is None:
            self._owner = deepest_holder(self._depths, self._load_of, self._computing)
        return self._owner, self._num_fetchable

    @property
    def credit_open(self) -> bool:
        """Whether fetchable tokens lower non-owners' costs in this decision."""
        if self._credit_open is None:
            scope = self._credit_scope
            self._credit_open = bool(self._num_fetchable) and (
                scope == "always" or (scope == "over_bound" and self._is_over(*self.fetchable)))
        return self._credit_open

    def held(self, replica_id: str, cached: int) -> int:
        """Tokens of the prompt ``replica_id`` holds (``cached``: what the score counts)."""
        if not self._num_fetchable or replica_id in self._depths:
            return cached
        depth_tokens = self._depth_of(replica_id) * self._block_size
        return max(cached, min(depth_tokens, self._num_prompt_tokens - 1))

    def credit(self, replica_id: str, cached: int) -> float:
        if not self.credit_open:
            return 0.0
        return fetch_credit(self.fetchable, replica_id, self.held(replica_id, cached), self._min_tokens,
                            self._fetch_token_cost)

    def hint(self, first_id: str, cached: int, backup: bool = False) -> FetchHint | None:
        """The first choice's hint (:func:`hint_for`); with ``backup``, a
        first choice the index counts among the holders of all but at most
        ``min_tokens`` of the fetchable prefix gets a hint naming another
        holder of all of it (:meth:`backup_hint`). Either names up to
        ``max_alternates`` more holders (:meth:`_alternates`: those that
        have computed its tokens first, then least loaded first)."""
        held = self.held(first_id, cached)
        if self._num_fetchable - held > self._min_tokens:
            target = hint_target(first_id, held, self.fetchable, self._min_tokens)
        elif backup:
            target = self._backup_target(first_id)
        else:
            return None  # nothing worth a fetch, whoever the owner (no owner looked up)
        return None if target is None else FetchHint(*target, self._alternates(target, first_id))

    def backup_hint(self, first_id: str) -> FetchHint | None:
        """For a first choice the index counts among the holders of the
        fetchable prefix, or of all but at most ``min_tokens`` of it: a hint
        naming the least loaded of the deepest other holders, for as much as
        they hold, so that a first choice which evicted the prefix since its
        last report fetches it instead of recomputing it. A receiver that
        still holds it ignores the hint (the worker checks its own cache
        first). None when no other holder holds more than ``min_tokens``.
        The first choice need not be among the listed candidates: a holder
        past ``max_affinity_candidates`` that joined as a ring node is read
        from the index (``depth_of``), and the listed holders back it up.

        Why a shallower holder too: a chat's turn fetched to a new home
        leaves the turns before it on the old one, and a replica evicts a
        fetched copy before what it computed (cache/segmented_lru.py), so
        the new home may lose the chat while the router's index, within
        ``learned_grace_s`` of routing there, still credits it. Simulated
        multi-turn FIFO, workload seed 5: the next turn recomputed 1,024
        tokens the old home held, until the backup named it.

        Why "all but a few": a radix cache evicts a prefix from its deepest
        block up, so a replica whose last report still showed all but the
        last block of a system prompt is evicting it; with no hint, the
        request recomputed all of it there while two other replicas held it
        (shared-prefix FIFO, fetched holders made on long queues).
        """
        target = self._backup_target(first_id)
        return None if target is None else FetchHint(*target)

    def _backup_target(self, first_id: str) -> tuple[str, int] | None:
        """:meth:`backup_hint`'s ``(owner, num_tokens)``."""
        depths, num_fetchable = self._depths, self._num_fetchable
        if num_fetchable <= self._min_tokens:
            return None
        first_depth = depths[first_id] if first_id in depths else self._depth_of(first_id)
        first_tokens = min(first_depth * self._block_size, self._num_prompt_tokens - 1)
        if num_fetchable - first_tokens > self._min_tokens:
            return None  # the ordinary hint rule applies
        others = {r: d for r, d in depths.items() if r != first_id}
        if not others:
            return None
        num_tokens = min(max(others.values()) * self._block_size, num_fetchable)
        if num_tokens <= self._min_tokens:
            return None
        return deepest_holder(others, self._load_of, self._computing), num_tokens

    def _alternates(self, target: tuple[str, int], first_id: str) -> tuple[str, ...]:
        """Up to ``max_alternates`` candidates besides the owner known to hold
        the tokens of the hint ``target`` (``(owner, num_tokens)``), never
        ``first_id``: those that have computed them first, then least loaded first."""
        if not self._max_alternates or len(self._depths) < 2:
            return ()  # no holder besides the owner to name
        owner, num_blocks = target[0], target[1] // self._block_size
        others = sorted((r for r, d in self._depths.items() if d >= num_blocks and r != first_id and r != owner),
                        key=lambda r: holder_order(r, self._load_of, self._computing))
        return tuple(others[:self._max_alternates])

    def replica_credit(self, has_room: Callable[[str, int], bool],
                       token_cost: float | None = None) -> Callable[[str, int], float]:
        """The credit of a decision that may make another holder of a hot
        prefix (``replicate_hot_prefixes``): :func:`fetch_credit` at
        ``token_cost`` (default ``fetch_token_cost``) for every candidate
        whose cache ``has_room(replica_id, tokens)`` for the fetchable
        tokens, 0 for the others (whatever the credit scope)."""
        fetchable, min_tokens = self.fetchable, self._min_tokens
        cost = self._fetch_token_cost if token_cost is None else token_cost

        def credit(replica_id: str, cached: int) -> float:
            if fetchable is None or not has_room(replica_id, fetchable[1]):
                return 0.0
            return fetch_credit(fetchable, replica_id, self.held(replica_id, cached), min_tokens, cost)
        return credit

    def booked_tokens(self, hint: FetchHint | None) -> int:
        """Tokens the reservation counts as fetched (at ``fetch_token_cost``):
        the hint's where the credit was open (fetch chose the replica), else 0
        (the no-fetch decision, booked as without fetch: the router's state
        moves with fetch only through what the replicas report)."""
        return hint.num_tokens if hint is not None and self.credit_open else 0


def fetchable_tokens(depths: Mapping[str, int], block_size: int, num_prompt_tokens: int,
                     load_of: Callable[[str], float]) -> tuple[str, int] | None:
    """``(owner, tokens)``: the deepest holder among ``depths`` (replica →
    leading blocks held; the least loaded among equally deep ones) and how
    many leading prompt tokens a fetch from it could bring: whole blocks,
    below the prompt's length. None if nobody holds a full block of it.
    O(holders)."""
    num_tokens = fetchable_num_tokens(depths, block_size, num_prompt_tokens)
    return (deepest_holder(depths, load_of), num_tokens) if num_tokens else None


def fetchable_num_tokens(depths: Mapping[str, int], block_size: int, num_prompt_tokens: int) -> int:
    """The tokens of :func:`fetchable_tokens`, 0 for None."""
    if not depths:
        return 0
    num_blocks = min(max(depths.values()), (num_prompt_tokens - 1) // block_size) if num_prompt_tokens > 0 else 0
    return num_blocks * block_size if num_blocks > 0 else 0


def deepest_holder(depths: Mapping[str, int], load_of: Callable[[str], float],
                   computing: Callable[[str], bool] | None = None) -> str:
    """The owner of :func:`fetchable_tokens`: among the deepest holders, one
    that has computed the prefix if any (``computing``: :class:`FetchPlan`),
    the least loaded."""
    deepest = max(depths.values())
    return min((r for r, d in depths.items() if d == deepest), key=lambda r: holder_order(r, load_of, computing))


def holder_order(replica_id: str, load_of: Callable[[str], float],
                 computing: Callable[[str], bool] | None) -> tuple[bool, float, str]:
    """Sort key of holders a hint may name: computed first, then least loaded, then by id."""
    return computing is not None and computing(replica_id), load_of(replica_id), replica_id


def fetch_credit(fetchable: tuple[str, int] | None, replica_id: str, cached: int, min_tokens: int,
                 fetch_token_cost: float) -> float:
    """Prefill-token equivalents ``replica_id`` saves by fetching rather than
    computing what it lacks of the fetchable prefix: ``(1 - fetch_token_cost)``
    per token, when it lacks more than ``min_tokens`` of it (else 0)."""
    if fetchable is None or fetchable[0] == replica_id:
        return 0.0
    missing = fetchable[1] - cached
    return (1.0 - fetch_token_cost) * missing if missing > min_tokens else 0.0


def within_block_hint(hint: FetchHint | None, first_held: int, within_replica: str | None,
                      within_held: int, min_tokens: int) -> FetchHint | None:
    """``hint``, or one naming ``within_replica`` (where an earlier prompt's
    partial last block went: :attr:`Candidates.within_replica`) for the
    ``within_held`` tokens it is known to hold, its full blocks and what it
    shares of the next, where those are more than ``min_tokens`` beyond the
    first choice's ``first_held`` and more than ``hint`` names. None is
    passed for a ``within_replica`` that is the first choice.

    The block index ranks holders by full blocks, so a first choice holding
    every full block of a repeated prompt gets no hint, while the replica
    that served it also holds the partial last block (up to a block less
    one token: 511 in a Mooncake replay). The receiver asks the owner for as
    much of the prompt as it holds, so the hint fetches that block too. It
    names no alternates: no other holder of those tokens is known."""
    if within_replica is None or within_held - first_held <= min_tokens:
        return hint
    if hint is not None and hint.num_tokens >= within_held:
        return hint
    return FetchHint(within_replica, within_held)


def hint_for(first_id: str, first_cached: int, fetchable: tuple[str, int] | None,
             min_tokens: int) -> FetchHint | None:
    """The hint for a request whose first choice holds ``first_cached`` of its
    tokens (RoutingDecision's invariants)."""
    target = hint_target(first_id, first_cached, fetchable, min_tokens)
    return None if target is None else FetchHint(*target)


def hint_target(first_id: str, first_cached: int, fetchable: tuple[str, int] | None,
                min_tokens: int) -> tuple[str, int] | None:
    """:func:`hint_for`'s ``(owner, num_tokens)``."""
    if fetchable is None:
        return None
    owner, num_tokens = fetchable
    if owner == first_id or num_tokens - first_cached <= min_tokens:
        return None
    return fetchable
