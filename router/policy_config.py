"""Knobs of the routing rule (:class:`router.policy.PrefixAffinityPolicy`)."""

from __future__ import annotations

from dataclasses import dataclass

from router.policy_config_checks import check_policy_config


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Knobs of :class:`PrefixAffinityPolicy` (the rule, defaults and reasons
    are in its docstring). Token counts are in tokens, times in seconds.

    ``balance_output_price`` = "queue" with ``load_factor`` = 1.1 (issue 14,
    item 4; BENCHMARKS.md "Cache turnover under batching"): the balance term
    prices an expected output token at ``queue_decode_token_cost`` — what it
    takes from the other requests on its replica — scaled back to work
    units, so under batching the term balances the prompt tokens each
    replica computes (its cache turnover) and the bound, on busy time
    (``decode_token_cost`` per output token), alone holds busy time; at a
    bound of 1.25 busy-time imbalance drifted to 1.13-1.18, at 1.1 it holds.
    "busy" prices it at ``decode_token_cost`` (the default until
    2026-12-02). Where the two prices are equal (FIFO replicas; a live
    router not given a queue price) "queue" changes nothing and 1.1 did not
    bind in any FIFO run. Measured: Mooncake 1.25M batching hit 0.5689 ->
    0.5740 (mean over summary periods 0.9/1.0/1.1 s; llm-d 0.5727), 6.25M
    TTFT p99 2.684 -> 2.571 s; multi-turn batching imbalance 1.164 -> 1.141
    (mean over workload seeds 0-15; seed 0 alone went 1.087 -> 1.148, which
    kept "busy" the default while only seeds 0-2 were run).

    ``balance_busy_share`` = 0.25 (issue 14, item 4; BENCHMARKS.md "Observed
    busy time in the balance term"): a quarter of the balance term's measure
    is each replica's recent busy time as this router saw it (the union of
    its requests' spans, routed to completed; :class:`router.busy_spans.
    BusySpans`), scaled so its mean is the mean recent work. Load imbalance
    is busy time, and under batching at a mean decode batch of ~1.2-1.5 a
    replica's busy time is the union of its requests' decode spans, which
    no per-token price predicts. Measured over workload seeds 0-15 (0-39):
    batching imbalance shared-prefix 1.089 -> 1.067 (1.100 -> 1.070),
    multi-turn 1.104 -> 1.083 (1.093 -> 1.082); Mooncake 1.25M hit within
    the summary-period noise (nine periods: FIFO 0.5914 -> 0.5909, batching
    0.5934 -> 0.5939); at heavy batching load hit 0.5957 -> 0.5930 (llm-d
    0.5920) for imbalance 1.064 -> 1.040. 0 turns it off (the rule before
    2026-12-06).

    ``balance_busy_share`` = 0.6 with ``balance_weight`` = 0.6 (issue 13's
    imbalance <= 1.05; 2026-12-06, later; BENCHMARKS.md "A stronger balance
    term"): most of the measure busy time, and the term three times as
    strong. Load imbalance over workload seeds 0-15 (0-39), hit unchanged
    but where said: shared-prefix FIFO 1.058 -> 1.045 (1.070 -> 1.050),
    batching 1.067 -> 1.049 (1.070 -> 1.050); multi-turn FIFO 1.056 ->
    1.039 (hit 0.8987 -> 0.8984), batching 1.083 -> 1.049 (1.082 ->
    1.050); Mooncake 1.25M over nine summary periods: FIFO 1.019 -> 1.013
    (hit 0.5909 -> 0.5898, TTFT p99 2.787 -> 2.840 s), batching 1.064 ->
    1.047 (hit 0.5939 -> 0.5917, llm-d 0.5931), heavy 1.040 -> 1.042 (hit
    0.5930 -> 0.5927). Live (2 CPU Workers, multi-turn 48 chats, two A/Bs
    with the arm order swapped): busy imbalance 1.055 / 1.051 -> 1.008 /
    1.008, hit 0.914 / 0.913 -> 0.910 / 0.912. So the balance goal holds
    everywhere measured for ~0.001-0.004 of hit; a deployment that puts
    hits first sets the two back to 0.25 and 0.2 (the rule before).

    ``busy_from_reports`` = True with ``reported_busy_share`` = 0.8 (issue
    14, item 6; 2026-12-06, session 46; BENCHMARKS.md "Several routers read
    the replicas' busy time"): once :class:`RouterShare` reads more than one
    router and every replica has reported, the busy part of the balance term
    is the replicas' own busy-time counters (``CacheSummary.busy_s_total``)
    topped up with this router's spans since each report
    (:class:`router.reported_busy.ReportedBusy`), 0.8 of the measure. A
    lone router is untouched. With 0.25 s summaries, workload seeds 0-39,
    imbalance against one router at 1 s, 2 / 4 routers: shared-prefix FIFO
    +0.012 / +0.023 -> +0.006 / +0.009, batching +0.038 / +0.066 -> +0.001
    / +0.028; multi-turn FIFO +0.003 / +0.006 -> 0.000 / +0.006, batching
    +0.028 / +0.032 -> -0.007 / -0.005; hit within 0.006 of one router in
    all (as before). At 0.6 (the lone router's share) or 1.0 it did less.

    ``split_affinity_by_holders`` = True with ``balance_weight`` = 0.2 (0.6 since, above)
    (issue 14, item 4; BENCHMARKS.md "Router policy defaults"): a cached
    token earns the affinity premium (``w`` above 1) divided by the number
    of replicas known to hold its block. A system prompt the first few
    replicas cached had pulled every new conversation to them (its 512
    tokens weighed like a conversation's own history) until the others were
    ~75 % behind in recent work, and the conversations stayed where they
    started: homes 4-11 per replica, multi-turn batching imbalance 1.141.
    With the premium split the balance term places new conversations, and
    at 0.2 (was 0.1) it is strong enough to: over workload seeds 0-15,
    multi-turn batching imbalance 1.141 -> 1.082, shared-prefix batching
    1.117 -> 1.096 (max 1.413 -> 1.202); multi-turn FIFO TTFT p99 1.362 ->
    1.185 s at hit 0.888 -> 0.872 (seeds 0-7); Mooncake 1.25M hit within
    the summary-period noise (batching 0.5740 -> 0.5751, FIFO 0.5733 ->
    0.5726, means over periods 0.9/1.0/1.1 s), 6.25M FIFO 0.6511 -> 0.6512.
    The split alone: multi-turn batching 1.105; 0.2 alone: 1.110 and
    Mooncake FIFO 0.5737 at 1.0 s.

    ``learn_token_costs`` = True: ``decode_token_cost`` and
    ``queue_decode_token_cost`` are priors. Once replicas report what their
    engines measured (``CacheSummary.decode_token_cost`` /
    ``queue_token_cost``, fitted by each Worker from its own steps), the
    median of their reports replaces them (:class:`router.token_prices.
    ReportedTokenPrices`). A live router was otherwise left with the FIFO
    price (40 and 40) in front of a batching engine whose lone decode step
    costs ~200 prefill tokens of busy time and whose decoding sequence
    delays a queued prefill by ~5 (tiny-llama, one CPU thread). The
    simulator's replicas report their cost model's prices, which are also
    its policy's priors, so simulated figures do not move.
    ``price_history`` = 16: the prices in force are the median of each
    replica's last 16 reports, pooled (:class:`ReportedTokenPrices`), and
    the balance term reads every booking at the prices in force when it
    reads it (:class:`router.queue_priced.QueuePricedWork`). Live, 2 CPU
    Workers, multi-turn 48 chats (2026-12-03): latest reports priced at
    booking hit 0.893-0.898 and imbalance 1.12-1.19 against 0.905-0.908
    and 1.01 for configured 40 / 40 in four A/Bs; both changes together
    0.907 and 1.07 (configured 0.905 in the same run), TTFT p99 0.303 s
    (configured 0.334 s).

    ``premium_needs_completion`` = True with ``premium_pending_min_users``
    = 4 (2026-12-03; off until then): blocks an in-flight request at a
    replica has yet to compute earn no affinity premium there while at least
    4 in-flight requests there wait on them, those are more than one
    replica's share of this router's requests in flight, and the caches have
    room. Live, 2 CPU Workers, multi-turn 24 chats x 4 turns (8 chats start
    at once on one system prompt): TTFT p99 0.369 s against 0.663 s, hit
    0.892 against 0.880 (higher every round); shared-prefix 0.878 against
    0.875, p99 0.316 against 0.345 s. With 2 waiting requests as the burst
    (the first setting) live was alike, but over workload seeds 0-15 at 8
    replicas a group's queued pair met the condition and imbalance rose
    (shared-prefix FIFO 1.119 -> 1.131, batching 1.096 -> 1.111,
    multi-turn batching 1.084 -> 1.103); with 3, shared-prefix FIFO 1.123;
    with 4 every simulated run checked is identical to the rule off
    (shared-prefix and multi-turn FIFO/batching seeds 0-15 and at 2 and 4
    routers, Mooncake 1.25M at 0.9/1.0/1.1 s periods, 6.25M, heavy load).

    ``replicate_hot_prefixes`` = True with ``hot_prefix_share`` = 0.25 and
    ``replica_room_factor`` = 2, 1.5 since (2026-12-04; BENCHMARKS.md "Hot prefixes
    gain fetched holders"): a prefix whose recent work per holder is above
    a quarter of a replica's mean recent work credits a candidate whose
    last report had room for 1.5 copies its fetchable tokens as if
    cached, so the lighter of holders and would-be holders takes the
    request and fetches the prefix. Before it, at 8 replicas x 16 equally
    popular groups, the cost rule homed 3 groups on one replica in some
    workload seeds, and that replica stayed the hot spot until the bound's
    chance slack ran out. Over workload seeds 0-15: shared-prefix FIFO
    imbalance 1.119 -> 1.088 (max 1.225 -> 1.266, seed 8), TTFT p99 0.445 ->
    0.265 s, hit 0.8824 either way (the optimum); batching 1.096 -> 1.096;
    multi-turn FIFO 1.052 -> 1.057 (p99 1.094 -> 1.088 s), batching 1.084
    -> 1.104 (seeds 0-39: 1.091 -> 1.093, noise); Mooncake 1.25M/6.25M
    FIFO/batching and heavy load: every decision's figures identical (no
    prefix there draws a quarter of a replica per holder with room for a
    copy). Measured with the first weighting (0.9 of each fetched token,
    then the affinity weight): without the room check shared-prefix FIFO
    lost 0.0010 of hit (copies evicted the only copy of another group);
    ``hot_prefix_share`` 0.2 lost 0.0012, 0.3 gave imbalance 1.092 and
    batching 1.119. ``replica_room_factor`` 2 -> 1.5 (2026-12-04, later;
    BENCHMARKS.md "Room for one and a half copies"): at 2 the only replicas
    with room were sometimes those already holding two groups, and a hot
    group's new holders piled there (seed 8: 1.266); over seeds 0-39
    shared-prefix FIFO 0.8823 / 1.095 / 0.285 s -> 0.8824 / 1.075 / 0.275 s
    (every seed at the optimal hit), batching 1.102 -> 1.100, multi-turn and
    Mooncake identical; below 1.5 a group lost its prefix (seed 7: hit
    0.8787): two of its holders evicted it while the index, within
    ``learned_grace_s``, still listed them.
    It needs fetch that pays, and asks the Workers: each reports what a fetch costs
    it (``CacheSummary.fetch_token_cost`` / ``fetch_overhead_tokens``), and
    where that is a recompute's cost or more (the CPU demo: tiny-llama's
    1,024-token prefix recomputes in ~10 ms against a ~50 ms fetch) no
    holder is offered; live there, the first version, which assumed
    ``fetch_token_cost``, moved requests whose fetches all fell back
    (hit 0.849 -> 0.803, BENCHMARKS.md). ``max_replica_fetch_cost`` = 0.5:
    offered only where a fetch costs at most half a recompute. A fetch is
    only an estimate until it runs; at the break-even the CPU demo's
    Workers reported ~1 (tiny-llama), opened now and then, and a moved
    request outwaited a 6 MB/s fetch (hit 0.849 -> 0.833); the simulated
    H100 links cost 0.12, a ~125M model on this CPU ~0.2.
    ``backup_fetch_hints`` = True: a first choice that is one of several
    deepest holders is hinted to another; a replica that evicted its copy
    since its last report fetches it instead of recomputing (shared-prefix
    FIFO with replication but no backup hints: hit 0.8810). Alone, it
    changes no simulated figure. Since 2026-12-04 (later; BENCHMARKS.md
    "Alternate holders and queued copies") it also goes to a first choice
    the index counts among the holders of all but at most
    ``fetch_min_tokens`` of the prefix: a radix cache evicts from the
    deepest block up, and such a replica, hinted nothing, recomputed a
    whole system prompt two others held. Since 2026-12-06 (session 48;
    BENCHMARKS.md "A fetch takes all the owner holds") a first choice
    deepest alone is backed up by the deepest of the others, for what they
    hold: a chat's old home after a turn moved (multi-turn FIFO 0.8983 ->
    0.8989 over 16 seeds, with the receiver asking for all the owner holds).
    ``fetch_alternates`` = 2: a hint names up to two more holders as deep
    as it hints (``FetchHint.alternates``), least loaded first; the worker
    asks them in turn when the owner evicted the prefix (the index lags
    evictions by up to a summary period). Alone, neither changes any
    simulated figure measured; with queued copies, shared-prefix FIFO over
    seeds 0-39 lost a group's prefix in 6 seeds without alternates, in 1
    with them (there every replica had evicted it).
    ``hot_affinity_weight`` = 5.5 at ``hot_affinity_share`` = 0.1
    (2026-12-06, session 49; BENCHMARKS.md "A prefix in demand weighs
    less"): a request whose known prefix drew more than a tenth of a
    replica's mean recent work per replica holding it weighs its cached
    tokens at 5.5, not 16, where the replicas report that a fetch pays
    (as for ``replicate_hot_prefixes``). The premium stands for the later requests that
    will reuse the prefix where it is cached; a prefix in that much demand
    spreads over more replicas whatever this request does, so a lighter
    replica that recomputes or fetches it wins sooner than a queue at its
    holder. Over workload seeds 0-39: shared-prefix FIFO imbalance 1.050
    -> 1.027, TTFT p99 0.278 -> 0.199 s, hit the optimum either way;
    multi-turn FIFO hit 0.8988 -> 0.8989, batching imbalance 1.050 ->
    1.049; Mooncake 1.25M (nine summary periods, both models): every
    figure identical (no prefix there draws that much per holder). A
    global ``affinity_weight`` of 5.5 gave shared-prefix FIFO 0.177 s but
    cost multi-turn FIFO 0.006 of hit (moved chats' histories fill the
    caches twice); gating it on the replication rule's hotness (a quarter
    of a replica's work) left shared-prefix's waits untouched (0.246 s).
    ``fetch_awaits_prefill`` = True (2026-12-06, session 51; BENCHMARKS.md
    "A fetch waits for the owner's prefill in flight"): both demand rules
    also act on a prefix every holder still computes, since the Workers'
    fetch waits for that prefill (``ExportRequest.wait_s``; the hint says
    so, ``FetchHint.owner_computing``). Off, they do not (session 50's
    gate: a new holder would recompute it). Over workload seeds 0-39:
    shared-prefix FIFO hit 0.8823 -> 0.8824 (every seed), TTFT p99 0.211
    -> 0.198 s; multi-turn batching 0.8988 -> 0.8990; Mooncake identical.
    ``queue_copy_requests`` = 1 (session 52; 0, off, before): at q > 0, a
    request whose every holder candidate has more than q typical requests'
    work queued credits a candidate with at least ``queue_copy_gap_requests``
    (1) typical requests less queued and room at its last report for
    ``queue_copy_room_factor`` (2) x the copy as a hot prefix's would-be
    holder. Ungated (2026-12-04, q = 2) it met shared-prefix FIFO's TTFT
    goal but cost Mooncake 1.25M hit (batching 0.5751 -> 0.5681): copies
    where the fleet's cache is the constraint. Since session 52 a copy is
    only of a prefix prompts branch at (a system prompt, not a chat's
    history), held by one candidate that has computed it and queues what
    it has in flight (it does not batch, or reported requests waiting),
    and a hint names holders that have computed the prefix first: over
    seeds 0-39 shared-prefix FIFO 0.8824 / 1.026 / 0.198 s -> 0.8824 (every
    seed) / 1.022 / 0.178 s (goal 0.182 s); BENCHMARKS.md "Queued copies of
    a branching prefix". ``queue_copy_size_factor`` = 2 (session 53): a
    holder not seen batching must also have queued that many times the
    copy's tokens. A copy occupies a second cache for as
    long as both replicas serve the prefix, so a wait shorter than a couple
    of copies' prefill does not pay for it: on Mooncake 1.25M under FIFO
    the rule copied 15-56k-token contexts while the caches filled (queues
    mostly of 0.3-2.7 copies), and ~1.3 % of the fleet's cache held such
    second copies; shared-prefix's copies wait behind 2.6-6 copies' work (a
    1,024-token system prompt) and are kept. For a batching holder (one
    that reports requests waiting has its batch or KV cache full) the floor
    cost heavy Mooncake batching 0.0010 of hit and moved shared-prefix
    batching's imbalance 1.045 -> 1.050, so a holder seen running two
    requests at once has none.

    ``turnover_weight`` = 4 (session 53; BENCHMARKS.md "Cache turnover
    under FIFO"): step 3 adds ``turnover_weight x pressure x (written(r) /
    mean - 1)`` per uncached prompt token a candidate would write, for a
    candidate seen to serve one request at a time (requests waited while it
    ran one, and it never ran two: :class:`router.replica_queueing.
    ReplicaQueueing`); ``written`` is the tokens written into its cache
    lately (:class:`router.cache_turnover.CacheTurnover`: its counters plus
    this router's sends) and ``pressure`` the fleet's share of full caches
    (:class:`router.cache_fill.FleetCacheFill`: while caches have room, a
    write evicts nothing). A full LRU cache written faster evicts what was
    used more recently. Balanced on busy time, a FIFO replica that drew long
    answers prefills half as much as the others and they churn (Mooncake
    1.25M: prompt tokens computed 1.9M against 3.2-3.7M); under batching
    the same balance keeps them within 0.84 of each other, and the term
    moved shared-prefix batching's imbalance 1.045 -> 1.052 for no hit,
    hence the gate. A price below 0 (a cache churning slower than the mean)
    counts only for a cold request: for a warm one it drew the request off
    its holder to write the prefix again, and shared-prefix FIFO lost a
    system prompt in 2 of 40 seeds. ``batching_turnover_credit`` (session
    55, "Cold prompts go where caches turn over slowest"): at a batching
    server only that credit counts, so a cold prompt's writes go where a
    cache turns over slowest and warm routing is untouched: Mooncake
    batching hit +0.0014 (18 summary periods, 14 up), heavy batching
    -0.0003, the generated workloads unchanged.

    ``cold_queue_weight`` = 2 (session 54; BENCHMARKS.md "A cold request does not queue at a FIFO
    server"): for a cold request (no candidate holds any of it) a candidate's queue weighs ``1 +
    cold_queue_weight`` times in step 3, at a candidate seen to serve one request at a time (the turnover
    term's gate). Nothing is cached anywhere to trade the request's wait for, and behind a FIFO queue it
    waits for all of it, where the balance term's credit for a replica below its share of the work is a
    long-run aim. Off, on Mooncake 1.25M under FIFO, 449 cold requests waited (194 of them while some
    replica was idle), against llm-d's 282 (none while one was idle), and ours' TTFT p99 was 0.1 s above
    llm-d's at the same hit rate. Under batching a queued request joins the next steps, and the weight
    raised Mooncake batching's imbalance 1.040 -> 1.052 for no TTFT gain, hence the gate. It trades against
    the turnover term, whose credit draws cold requests to the caches written slowest, the FIFO replicas
    busy decoding: at weight 4 Mooncake FIFO's TTFT p99 fell 0.121 s but its hit 0.0021; at 2, 0.095 s and
    0.0006 (18 summary periods).

    ``num_cold_candidates`` = 8 and ``cold_balance_share`` = 0.3 (session 64; BENCHMARKS.md "A cold
    request looks wider where caches have room"): while a placement evicts nothing (the ``fifo_work_left``
    gate: one router, room in every cache for twice the prompt, rates and output quantiles reported), a
    cold request's first 8 ring nodes compete, not 2 and the least booked (every replica of 8), and its
    balance term weighs 0.3 x. Its wait is all it trades, and the least *booked* replica is often not the
    one that frees first. Mooncake 6.25M FIFO TTFT p99 2.648 -> 2.582 s (36 periods paired, -0.066 +-
    0.011), imbalance 1.018 -> 1.007, hit equal; with full caches (1.25M, the generated workloads) the
    ring's two homes keep footprints spread: load-chosen homes cost shared-prefix FIFO a system prompt in
    3 of 40 seeds.

    Fetch knobs: ``fetch_min_tokens`` = 64 (one 64-token block; 256 until 2026-12-02). A hint is only an
    offer: the receiving worker weighs the transfer, fixed cost included, against recomputing with its own
    measured figures (``worker.kv_fetch.PrefixFetcher.should_fetch``), so the router need not guess that fixed
    cost; the one-block floor keeps hints for partial blocks, which never pay, off the wire. At 256 a
    multi-turn conversation's second turn never got a hint: a turn adds a question and an answer (128 + 128
    tokens), so a spilled second turn lacked exactly 256 tokens of its home's prefix and recomputed them, and
    its copy then competed with the home. Over workload seeds 0-15: multi-turn FIFO hit 0.873 -> 0.898, TTFT
    p99 1.131 -> 1.094 s, imbalance 1.063 -> 1.050; batching hit 0.894 -> 0.899, p99 0.024 -> 0.018 s,
    imbalance 1.082 -> 1.084; at 4 routers (seeds 0-7) batching hit 0.877 -> 0.899. Shared-prefix and Mooncake
    (512-token blocks) decide identically (0 gives the same figures).
    ``fetch_credit_scope`` = "never": fetch changes no score and no booking; a request goes where it would
    without fetch, and when that is not the owner (an owner over the bound, or far more queued) it carries the
    hint, so fetch only turns the no-fetch rule's spills into hits. Measured (BENCHMARKS.md, "KV fetch
    (simulated)"): against fetch off, hit as high or higher on every row, imbalance and p99 within noise, and
    multi-turn FIFO hit 0.853 -> 0.890, TTFT p99 1.789 -> 1.630 s. "always" (crediting fetchable tokens
    against any owner) moved requests from homes that could take them into second copies (multi-turn batching
    imbalance 1.087 -> 1.110); "over_bound" took it to 1.168.
    ``fifo_work_left`` and ``queue_copy_any_prefix`` (session 60;
    BENCHMARKS.md "Work left at a FIFO server"): while caches have room,
    a FIFO replica's running request weighs what it has left (:class:`router.
    work_left.WorkLeft`), and a queued copy may be of any prefix: Mooncake
    FIFO TTFT p99 6.25M 2.731 -> 2.648 s, 1.25M 2.807 -> 2.776 s, hit equal.
    ``fetch_token_cost`` = 0.1, used by the credit and its booking (not by
    "never"): Llama-3.1-8B keeps 128 KiB per token in bf16, so at 25 GB/s
    a token moves in ~5 µs against ~50 µs to prefill it on an H100; the
    worker still decides with its own measured figures. Booking hinted
    requests at that cost under "never" moved Mooncake 1.25M FIFO hit by
    -0.0096 / +0.0019 at 1.0 / 0.9 s periods (a chaotic replay): the
    default books no-fetch decisions exactly as without fetch.
    ``fetch_affinity_share`` = 0 (with a credit scope other than "never"):
    fetchable tokens lower a replica's cost only by what they save now;
    1 weighs them like cached tokens (a fetched prefix serves later turns
    too), which routes nearly by load and fetches — better TTFT under FIFO
    decode queueing, but more copies, so fewer hits where the fleet's
    cache is tight. With ``fetch_enabled`` False the policy ranks exactly
    as before fetch existed; with "never" (and ``replicate_hot_prefixes`` and
    ``hot_affinity_weight`` off, which weigh a prefix differently where a
    fetch pays) it ranks and books the same given the same reports, and only adds hints.
    """

    block_size: int = 64  # tokens per routing block; ingress and workers use the same
    sub_block_tokens: int | None = None  # within-block match grain; None: block_size / 4, at most 16; 0: off
    load_factor: float = 1.1  # c: recent work of a replica <= c x mean (+ one request + chance)
    load_slack_sd: float = 2.0  # z: standard deviations of chance imbalance the bound tolerates
    affinity_weight: float = 16.0  # alpha: weight of a fully cached prompt's tokens vs load
    hot_affinity_weight: float | None = 5.5  # alpha for a prefix drawing beyond its holders (None: off)
    hot_affinity_share: float = 0.1  # ... more than this share of a replica's mean recent work per holder
    split_affinity_by_holders: bool = True  # a cached token's premium (w - 1) / the replicas holding its block
    premium_needs_completion: bool = True  # no premium for blocks in flight there that a burst of requests waits on
    premium_pending_min_users: int = 4  # a burst: at least this many in-flight requests there wait on them
    load_window_s: float = 120.0  # decay time of the recent-work counters
    num_ring_candidates: int = 2  # ring nodes from the prompt's key that compete
    max_affinity_candidates: int = 4  # holders of the deepest known blocks that compete
    decode_token_cost: float = 40.0  # prefill-token equivalents per expected output token (busy time, balance)
    queue_decode_token_cost: float | None = None  # the same, as delay to requests behind it; None: decode_token_cost
    learn_token_costs: bool = True  # both prices follow what the replicas measure (CacheSummary), these are priors
    price_history: int = 16  # each replica's last reports whose pooled median sets the learned prices
    virtual_nodes: int = 128  # ring points per replica
    max_blocks_per_replica: int = 1 << 18  # index entries per replica (memory bound)
    learned_grace_s: float = 5.0  # own decisions a summary may not reflect yet
    in_flight_timeout_s: float = 600.0  # forget in-flight work never reported complete
    reservation_timeout_s: float = 5.0  # forget a decision never reported sent
    max_partial_entries: int = 1 << 17  # within-block keys remembered (memory bound)
    num_ranked: int = 3  # replicas returned, best first
    balance_weight: float = 0.6  # beta: cost per token of recent work above the mean (below: a credit)
    balance_output_price: str = "queue"  # an output token in the balance term: queue (queue_decode_token_cost) | busy
    balance_busy_share: float = 0.6  # share of the balance term's measure that is observed busy time (BusySpans)
    busy_from_reports: bool = True  # with several routers, busy time from the replicas' counters (ReportedBusy)
    reported_busy_share: float = 0.8  # balance_busy_share while those counters are read
    balance_from_reports: bool = False  # balance on the replicas' reported work counters (shared; measured worse: they lag)
    balance_dead_sd: float = 0.0  # chance deviations of recent work the balance term ignores (2: worse, measured)
    prior_output_tokens: int = 256  # expected output length until a replica reports its mean
    tie_by_recent_work: bool = False  # break cost ties by this router's recent work before ring order
    balance_fleet_scale: bool = True  # scale balance_weight by how many routers share the traffic (RouterShare)
    load_peer_estimate: bool = False  # add (routers - 1) x this router's work since a replica's report to its load
    bound_fleet_scale: bool = False  # the bound's one-request slack / the number of routers (RouterShare)
    peer_queue_until_report: bool = True  # another router's shared decision is queued work there until the next report
    peer_queue_until_done: bool = False  # ... and, at a FIFO replica, while its reports' request count may still hold it
    peer_prefill_from_reports: bool = True  # seeing other routers: a report's prefill in progress (num_prefilling_tokens) is work
    drain_foreign_load: bool = False  # other routers' reported work drains at the fastest rate seen since the report
    cold_home: str = "cost"  # where a cold request goes: cost | ring | bounded | least_of_two (router.cold_home)
    cold_home_load_factor: float = 1.25  # "bounded": a cold home's shared load <= this x the mean (+ one request)
    # Fetch (issue 13): a lighter replica may fetch a prefix from its holder instead of recomputing it.
    fetch_enabled: bool = True  # decide() may carry a FetchHint (scoring: fetch_credit_scope)
    fetch_min_tokens: int = 64  # hint only beyond this many tokens more than the first choice holds
    fetch_token_cost: float = 0.1  # a fetched token's cost in computed-token units (credit and its booking)
    fetch_affinity_share: float = 0.0  # share of the fetchable tokens weighed like cached ones (affinity_weight)
    fetch_credit_scope: str = "never"  # when fetchable tokens lower a non-owner's cost: never | over_bound | always
    replicate_hot_prefixes: bool = True  # a prefix drawing more than hot_prefix_share per holder may gain a fetched holder
    hot_prefix_share: float = 0.25  # its recent work per holder, in shares of a replica's mean recent work
    replica_room_factor: float = 1.5  # a new holder's last report has room for this many times the fetched tokens
    max_replica_fetch_cost: float = 0.5  # ... and a fetch costs it at most this share of recomputing (reported)
    max_demand_entries: int = 1 << 16  # prefixes whose demand is remembered (memory bound)
    backup_fetch_hints: bool = True  # a first choice among the deepest holders gets a hint naming another holder
    fetch_awaits_prefill: bool = True  # the Workers' fetch waits for an owner's prefill in flight: a pending prefix counts
    fetch_alternates: int = 2  # other known holders a hint names, asked in turn when the owner evicted the prefix
    queue_copy_requests: float = 1.0  # q: every holder queued beyond q typical requests -> a lighter one may copy
    queue_copy_gap_requests: float = 1.0  # ... with at least this many typical requests less queued than each
    queue_copy_room_factor: float = 2.0  # ... and room at its last report for this many times the copy
    queue_copy_size_factor: float = 2.0  # ... and the holders' queued work at least this many times the copy
    turnover_weight: float = 4.0  # price per token written where a full cache turns over faster than the mean
    batching_turnover_credit: bool = True  # ... and at a batching server a cold request's credit where it is slower
    cold_queue_weight: float = 2.0  # a cold request's queue at a FIFO server weighs 1 + this
    fifo_work_left: bool = True  # with room in caches, a FIFO replica's running request weighs what it has left
    num_cold_candidates: int = 8  # ... and a cold request's ring nodes that compete (not num_ring_candidates)
    cold_balance_share: float = 0.3  # ... and its balance term's share of balance_weight
    queue_copy_any_prefix: bool = True  # ... and a queued copy from a FIFO holder may be of any prefix

    def __post_init__(self) -> None:
        check_policy_config(self)

    @property
    def queue_token_cost(self) -> float:
        """Delay an expected output token adds for requests queued behind it."""
        return self.decode_token_cost if self.queue_decode_token_cost is None else self.queue_decode_token_cost

    @property
    def within_block_tokens(self) -> int:
        """``sub_block_tokens``, or where None a quarter block, at most 16 where 16 divides it (0 where 4
        does not): 16 at 64 and at a Mooncake replay's 512, whose quarter missed a tail's last 127 tokens."""
        if self.sub_block_tokens is not None:
            return self.sub_block_tokens
        big = self.block_size > 64 and self.block_size % 16 == 0
        return 16 if big else (self.block_size // 4 if self.block_size % 4 == 0 else 0)
