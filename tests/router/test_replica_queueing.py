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
