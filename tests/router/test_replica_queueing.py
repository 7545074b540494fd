"""router.replica_queueing: whether a request in flight at a replica waits or runs."""

from router.replica_queueing import ReplicaQueueing


def test_a_replica_queues_unless_it_was_seen_batching_with_nothing_waiting():
    queueing = ReplicaQueueing()
    assert queueing.queues("a")  # no report yet: as a FIFO server
    queueing.report("a", num_running=1, num_waiting=3)
    assert queueing.queues("a")  # one at a time
    queueing.report("a", num_running=4, num_waiting=0)
    assert not queueing.queues("a")  # it batches what it has in flight
    queueing.report("a", num_running=1, num_waiting=0)
    assert not queueing.queues("a")  # seen batching before: a quiet moment is not a FIFO server
    queueing.report("a", num_running=8, num_waiting=2)
    assert queueing.queues("a")  # its batch is full: requests wait
    queueing.remove("a")
    assert queueing.queues("a")
    queueing.check_invariants()


def test_one_at_a_time_only_for_a_replica_seen_queueing_behind_one_and_never_running_two():
    queueing = ReplicaQueueing()
    assert not queueing.serves_one_at_a_time("a")  # no report: unknown
    queueing.report("a", num_running=1, num_waiting=0)
    assert not queueing.serves_one_at_a_time("a")  # a lightly loaded batching engine looks the same
    queueing.report("a", num_running=1, num_waiting=5)
    assert queueing.serves_one_at_a_time("a")  # requests wait while it runs one
    queueing.report("a", num_running=0, num_waiting=0)
    assert queueing.serves_one_at_a_time("a")
    assert not queueing.batches("a")
    queueing.report("a", num_running=2, num_waiting=0)
    assert not queueing.serves_one_at_a_time("a")  # seen batching once: a batching engine
    assert queueing.batches("a")
    queueing.remove("a")
    assert not queueing.serves_one_at_a_time("a")
    queueing.check_invariants()


def test_a_fifo_replica_keeps_the_newest_peer_decisions_its_report_may_hold():
    """Serving in arrival order, a replica holding n requests holds the n
    newest sent to it: of the other routers' decisions, the newest n less
    this router's own in flight there; older ones are forgotten for good."""
    queueing = ReplicaQueueing()
    queueing.report("a", num_running=1, num_waiting=2)
    for work in (100.0, 200.0, 300.0):
        queueing.add_peer("a", work)
    assert queueing.peer_work("a", 3, lambda replica_id: 0) == 600.0
    assert queueing.peer_work("a", 3, lambda replica_id: 1) == 500.0  # the oldest left first
    assert queueing.peer_work("a", 3, lambda replica_id: 0) == 500.0  # forgotten, not back
    assert queueing.peer_work("a", 1, lambda replica_id: 0) == 300.0
    assert queueing.peer_work("a", 1, lambda replica_id: 1) == 0.0  # the one left is this router's
    assert queueing.peer_work("b", 5, lambda replica_id: 0) == 0.0  # no peer decision there
    queueing.add_peer("a", -5.0)  # a negative booking counts as none
    assert queueing.peer_work("a", 1, lambda replica_id: 0) == 0.0
    queueing.check_invariants()


def test_a_batching_replica_keeps_no_peer_decisions_and_own_counts_are_asked_only_where_needed():
    queueing = ReplicaQueueing()
    asked = []

    def num_own(replica_id):
        asked.append(replica_id)
        return 0
    assert queueing.peer_work("a", 4, num_own) == 0.0 and asked == []  # nothing kept: nothing to count
    queueing.report("a", num_running=3, num_waiting=0)  # batches: what it runs does not wait in order
    queueing.add_peer("a", 100.0)
    assert queueing.peer_work("a", 3, num_own) == 0.0 and asked == []
    queueing.add_peer("b", 50.0)
    queueing.remove("b")
    assert queueing.peer_work("b", 3, num_own) == 0.0
    queueing.check_invariants()
