"""Steps 3–4 of :class:`router.policy.PrefixAffinityPolicy` for one request at
one moment: each candidate's cost and load bound, and the candidates in rank
order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.candidates import Candidates
from router.policy_config import PolicyConfig


@dataclass(slots=True)
class Scoring:
    """The terms of one decision that do not depend on the candidate, computed
    once; :meth:`order` then costs a few dict reads and calls per candidate.

    ``cost(r) = load(r) + T - w(r) * saved(r) - (cached(r) + credit(r) -
    saved(r)) + balance * beyond(balance_work(r) - mean_balance, dead)
    + turnover(r) * (T - cached(r))`` (the last term only where ``turnover``
    is given: the price of a token written there, for the uncached prompt
    tokens it writes; a price below 0, a cache churning slower than the
    mean, only for a cold request, which no candidate holds any of: for a
    warm one it would draw the request off its holder, to write the prefix
    again where the cache is cheap)
    ``+ cold_queue(r) * load(r)`` for a cold request (only where
    ``cold_queue`` is given: nothing is cached anywhere to trade its wait
    for, and at a FIFO server it waits for all of the queue), whose
    ``balance`` is ``cold_balance`` where that is given
    with ``saved = cached + fetch_share * credit`` (``fetch_share``:
    ``fetch_affinity_share``, or ``1 / (1 - fetch_token_cost)`` where a hot
    prefix may gain a holder: ``saved`` is then every fetched token, and
    the last term charges ``fetch_token_cost`` for each)
    and ``w = 1 + (alpha - 1) * premium(r) / T`` (``alpha``: the
    ``affinity_weight`` field where the policy set one, a prefix in demand
    at ``hot_affinity_weight``; else ``config.affinity_weight``), ``premium =
    saved`` or, with ``premium`` given, ``premium(cached) + fetch_share *
    credit``
    (:func:`holder_premium`), ``cached`` there only its computed part where
    ``computed`` is given (:class:`router.pending_blocks.PendingBlocks`);
    ``r`` is over the bound when
    ``recent(r) > load_factor * (mean_recent + work(r, cached) / N) +
    one_request * work(r, 0) + load_slack_sd * cached / T * chance_sd``,
    ``work(r, c) = T - c + decode_token_cost * expected_output(r)``. The
    formulas and their reasons: the policy's docstring, steps 3 and 4.
    Valid only until the router's state next changes (``recent`` and
    ``load`` read it as of ``now``).
    """

    config: PolicyConfig
    num_prompt_tokens: int  # T
    num_output_tokens: int  # the request's max_tokens
    mean_recent: float  # this router's recent work per replica
    chance_sd: float  # LoadTracker.chance_sd
    num_replicas: int  # N, at least 1
    one_request: float  # share of one request the bound tolerates beyond the mean
    balance: float  # the balance term's weight in force
    mean_balance: float
    dead: float  # deviations of balance work counted as none
    load: Callable[[str], float]  # queued work
    recent: Callable[[str], float]  # recent work
    expected_output: Callable[[int | None, str | None], float]  # OutputEstimate.expected
    balance_work: Callable[[str], float] | None = None  # None: ``recent``
    premium: Callable[[int], float] | None = None  # cached tokens -> those ``w`` counts (holder_premium); None: all
    computed: Callable[[str, int], float] | None = None  # (replica, cached) -> those the premium counts; None: all
    # share of the fetch credit weighed like cached tokens; None: fetch_affinity_share. Where a hot prefix may
    # gain a holder, 1 / (1 - fetch_token_cost): every fetched token weighs as cached, less its fetch cost once
    fetch_share: float | None = None
    affinity_weight: float | None = None  # w in force for this request; None: config.affinity_weight
    turnover: Callable[[str], float] | None = None  # replica -> price of a token written there; None: no term
    cold_queue: Callable[[str], float] | None = None  # replica -> extra weight of a cold request's queue there
    cold_balance: float | None = None  # the balance term's weight for a cold request; None: ``balance``

    def bound(self, replica_id: str | None, cached: int) -> float:
        """Most recent work ``replica_id`` may hold and still take the request:
        c × the mean after adding it, plus one request (the +1 of consistent
        hashing with bounded loads, so a lightly loaded fleet is never full),
        plus ``load_slack_sd`` chance deviations scaled by the share of the
        prompt cached there (moving a cached prefix costs its re-prefill;
        placing a cold one elsewhere costs nothing). ``None``: the fleet's
        expected output."""
        return self._bound(cached, self.config.decode_token_cost
                           * self.expected_output(self.num_output_tokens, replica_id))

    def _bound(self, cached: int, decode_work: float) -> float:
        config, num_prompt = self.config, self.num_prompt_tokens
        work_here = num_prompt - cached + decode_work
        slack = config.load_slack_sd * (cached / max(num_prompt, 1)) * self.chance_sd
        return (config.load_factor * (self.mean_recent + work_here / self.num_replicas)
                + self.one_request * (num_prompt + decode_work) + slack)

    def is_over(self, replica_id: str, cached: int) -> bool:
        return self.recent(replica_id) > self.bound(replica_id, cached)

    def order(self, found: Candidates, block_size: int,
              credit: Callable[[str, int], float] | None) -> tuple[list[tuple], dict[str, int]]:
        """``(entries, cached_at)``: one ``(is_over, cost, tie, ring rank,
        replica)`` per candidate, lowest first (ties broken by
        :meth:`Candidates.tiebreak`, then the id), and the tokens each holds.
        ``credit``: tokens a fetch saves there (None: none). The cost and
        :meth:`bound` written out, term for term (the same floats)."""
        config, num_prompt, num_output = self.config, self.num_prompt_tokens, self.num_output_tokens
        load, recent, expected, balance_work = self.load, self.recent, self.expected_output, self.balance_work
        depths, ring_rank, within_replica, within_tokens = (found.depths, found.ring_rank, found.within_replica,
                                                            found.within_tokens)
        num_ring, last_token, prompt_or_1 = len(ring_rank), num_prompt - 1, max(num_prompt, 1)
        per_saved = (config.affinity_weight if self.affinity_weight is None else self.affinity_weight) - 1.0
        saved_share = config.fetch_affinity_share if self.fetch_share is None else self.fetch_share
        decode_token_cost, tie_by_recent = config.decode_token_cost, config.tie_by_recent_work
        balance, mean_balance, dead = self.balance, self.mean_balance, self.dead
        load_factor, mean_recent, num_replicas = config.load_factor, self.mean_recent, self.num_replicas
        slack_sd, chance_sd, one_request = config.load_slack_sd, self.chance_sd, self.one_request
        premium, computed, turnover, entries, cached_at = self.premium, self.computed, self.turnover, [], {}
        cold = found.is_cold
        cold_queue = self.cold_queue if cold else None
        if cold and self.cold_balance is not None:
            balance = self.cold_balance
        for replica_id in found.replica_ids:
            cached = depths.get(replica_id, 0) * block_size + (within_tokens if replica_id == within_replica else 0)
            cached = last_token if cached > last_token else cached  # = max(0, min(cached, T - 1))
            cached = cached_at[replica_id] = 0 if cached < 0 else cached
            fetched = credit(replica_id, cached) if credit is not None else 0.0
            saved = cached + saved_share * fetched  # saved tokens that weigh w each
            # the premium's share of cached (of none cached, none: not asked)
            base = computed(replica_id, cached) if computed is not None and cached else cached
            premium_tokens = (base if premium is None else premium(base)) + saved_share * fetched
            weight = 1.0 + per_saved * premium_tokens / prompt_or_1
            recent_work = recent(replica_id)
            deviation = (balance_work(replica_id) if balance_work is not None else recent_work) - mean_balance
            beyond_dead = deviation - dead if deviation > dead else (deviation + dead if deviation < -dead else 0.0)
            queued = load(replica_id)
            cost = queued + num_prompt - weight * saved - (cached + fetched - saved) + balance * beyond_dead
            if cold_queue is not None:
                cost += cold_queue(replica_id) * queued
            if turnover is not None:
                price = turnover(replica_id)
                cost += (price if price > 0 or cold else 0.0) * (num_prompt - cached)
            decode_work = decode_token_cost * expected(num_output, replica_id)
            bound = (load_factor * (mean_recent + (num_prompt - cached + decode_work) / num_replicas)
                     + one_request * (num_prompt + decode_work) + slack_sd * (cached / prompt_or_1) * chance_sd)
            entries.append((recent_work > bound, cost, recent_work if tie_by_recent else 0.0,
                            ring_rank.get(replica_id, num_ring), replica_id))
        return _sorted(entries, found), cached_at


def holder_premium(levels: list[tuple[int, int]], block_size: int) -> Callable[[int], float] | None:
    """The part of a replica's cached tokens its affinity premium counts:
    each token over the number of replicas known to hold its block
    (``levels``: what :meth:`PrefixIndex.deepest_holders` fills), tokens past the last
    known block (a within-block match) whole. None when every known block
    has one holder (the premium is all of them).

    Why: the premium (``w`` above 1) stands for the later requests that will
    reuse the prefix where it is cached. When ``h`` replicas hold a part,
    those requests spread over the ``h``, so one holder's claim on them is
    ``1 / h``; and any of them taking this request leaves the part cached
    where it was. A shared system prompt every replica holds then weighs
    what it saves now, and no more, so it no longer pulls a new conversation
    towards the replicas that cached it first (and away from one that has
    not yet, for which the balance term had to open a ~75 % deficit).
    """
    if all(count <= 1 for _, count in levels):
        return None
    bounds = [(depth * block_size, count) for depth, count in reversed(levels)]  # shallowest first

    def premium(cached: int) -> float:
        total, start = 0.0, 0
        for end, count in bounds:
            if cached <= start:
                return total
            total += (min(cached, end) - start) / count
            start = end
        return total + (cached - start if cached > start else 0)
    return premium


def _sorted(entries: list[tuple], found: Candidates) -> list[tuple]:
    """``entries`` sorted as if each carried ``found.tiebreak(replica)``
    before its id, hashing only when two tie on everything before it. Two
    can tie only off the ring's first nodes (each ring node's rank is its
    own), so with at most one candidate off them no tie is looked for."""
    ordered = sorted(entries)
    if len(entries) - len(found.ring_rank) < 2 or all(a[:4] < b[:4] for a, b in zip(ordered, ordered[1:])):
        return ordered
    keyed = sorted(entry[:4] + (found.tiebreak(entry[4]), entry[4]) for entry in entries)
    return [key[:4] + key[5:] for key in keyed]


def beyond(deviation: float, dead: float) -> float:
    """``deviation`` shrunk towards 0 by ``dead`` (0 inside the dead zone)."""
    if deviation > dead:
        return deviation - dead
    if deviation < -dead:
        return deviation + dead
    return 0.0
