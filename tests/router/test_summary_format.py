"""cache.summary.CacheSummary: the record workers send and the router reads."""

import base64
import json

import pytest

from cache import RadixCache, block_hashes
from cache.summary import COMPACT_FORMAT, SUMMARY_FORMAT, CacheSummary, SummaryStream, cached_block_hashes


def summary_of(radix, **load):
    return CacheSummary.from_radix(radix, 4, replica_id="r1", version=3, timestamp_s=12.5, **load)


def test_from_radix_holds_every_cached_block_and_the_load():
    radix = RadixCache(1000, 4)
    radix.insert(list(range(10)))
    radix.insert([1, 2, 3, 4, 9, 9, 9, 9], salt="t")
    summary = summary_of(radix, num_queued_tokens=30, num_running_tokens=12, num_running=2, num_waiting=1)
    expected = set(block_hashes(list(range(10)), 4)) | set(block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4, "t"))
    assert summary.block_hashes == frozenset(expected) == frozenset(cached_block_hashes(radix, 4))
    assert (summary.num_cached_tokens, summary.budget_tokens) == (18, 1000)
    assert summary.load_tokens == 42


def test_round_trips_through_json_in_both_formats():
    radix = RadixCache(1000, 4)
    radix.insert(list(range(40)))
    summary = summary_of(radix, num_queued_tokens=5)
    v1 = json.loads(json.dumps(summary.to_dict(compact=False)))
    assert v1["format"] == SUMMARY_FORMAT and v1["num_blocks"] == 10
    assert CacheSummary.from_dict(v1) == summary
    v2 = json.loads(json.dumps(summary.to_dict()))
    assert v2["format"] == COMPACT_FORMAT
    assert CacheSummary.from_dict(v2) == summary


def test_an_empty_cache_round_trips():
    summary = summary_of(RadixCache(10, 4))
    assert CacheSummary.from_dict(summary.to_dict()) == summary
    assert CacheSummary.from_dict(summary.to_dict(compact=False)) == summary


def test_compact_wire_leaves_out_zeros_and_keeps_the_fields_read_before_parsing():
    radix = RadixCache(1000, 4)
    radix.insert(list(range(40)))
    stream = SummaryStream("r1@7")
    snapshot = stream.encode(summary_of(radix, num_running_tokens=12, num_running=1))
    radix.insert(list(range(100, 108)))
    delta = stream.encode(CacheSummary.from_radix(radix, 4, replica_id="r1", version=4, timestamp_s=13.5))
    for sent in (snapshot, delta):
        wire = json.loads(json.dumps(sent.to_dict()))
        assert (wire["version"], wire["epoch"]) == (sent.version, "r1@7")  # the router's has_seen reads these
        assert CacheSummary.from_dict(wire) == sent
    wire = delta.to_dict()
    assert "q" not in wire and "nw" not in wire and "rm" not in wire  # zero / empty: left out
    assert wire["bv"] == 3 and len(base64.b64decode(wire["h"])) == 8 * 2  # two blocks added
    full_v1 = len(json.dumps(delta.to_dict(compact=False)))
    assert len(json.dumps(wire)) < 0.6 * full_v1


def good_wire(compact=False):
    radix = RadixCache(100, 4)
    radix.insert(list(range(12)))
    return summary_of(radix).to_dict(compact)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d.pop("version"), "version"),
    (lambda d: d.update(version=-1), "version"),
    (lambda d: d.update(version=True), "version"),
    (lambda d: d.update(replica_id=""), "replica_id"),
    (lambda d: d.update(block_size=0), "block_size"),
    (lambda d: d.update(timestamp_s="now"), "timestamp_s"),
    (lambda d: d.update(timestamp_s=float("inf")), "timestamp_s"),
    (lambda d: d.update(block_hashes="@@not base64@@"), "base64"),
    (lambda d: d.update(block_hashes=[1, 2]), "base64"),
    (lambda d: d.update(num_blocks=d["num_blocks"] + 1), "8 x num_blocks"),
    (lambda d: d.update(block_hashes=base64.b64encode(b"1234567").decode()), "8 x num_blocks"),
    (lambda d: d.update(num_queued_tokens=-5), "num_queued_tokens"),
    (lambda d: d.update(num_running=1.5), "num_running"),
])
def test_malformed_v1_wire_raises_value_error_naming_the_field(change, message):
    wire = good_wire()
    change(wire)
    with pytest.raises(ValueError, match=message):
        CacheSummary.from_dict(wire)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="kvroute.cs.v9"), "format"),
    (lambda d: d.pop("version"), "version"),
    (lambda d: d.pop("bs"), "bs"),
    (lambda d: d.update(version=-1), "version"),
    (lambda d: d.update(replica_id=""), "replica_id"),
    (lambda d: d.update(bs=0), "block_size"),
    (lambda d: d.update(t="now"), "timestamp_s"),
    (lambda d: d.update(h="@@not base64@@"), "base64"),
    (lambda d: d.update(h=[1, 2]), "base64"),
    (lambda d: d.update(h=base64.b64encode(b"1234567").decode()), "multiple of 8"),
    (lambda d: d.update(q=-5), "num_queued_tokens"),
    (lambda d: d.update(nr=1.5), "num_running"),
    (lambda d: d.update(mo="many"), "mean_output_tokens"),
    (lambda d: d.update(rm=base64.b64encode(bytes(8)).decode()), "removed_hashes"),  # on a snapshot
])
def test_malformed_compact_wire_raises_value_error_naming_the_field(change, message):
    wire = good_wire(compact=True)
    change(wire)
    with pytest.raises(ValueError, match=message):
        CacheSummary.from_dict(wire)


@pytest.mark.parametrize("bad", [None, [], "summary", 3])
def test_not_a_dict(bad):
    with pytest.raises(ValueError, match="must be a dict"):
        CacheSummary.from_dict(bad)


def test_constructor_validates_too():
    with pytest.raises(ValueError, match="block_hashes"):
        CacheSummary("r", 1, 0.0, 4, {1, 2})


def test_mean_output_tokens_round_trips_and_defaults_to_zero():
    radix = RadixCache(1000, 4)
    summary = CacheSummary.from_radix(radix, 4, replica_id="r", version=1, timestamp_s=0.0, mean_output_tokens=37.5)
    assert CacheSummary.from_dict(summary.to_dict()).mean_output_tokens == 37.5
    wire = summary.to_dict(compact=False)
    del wire["mean_output_tokens"]  # an older worker
    assert CacheSummary.from_dict(wire).mean_output_tokens == 0.0
    with pytest.raises(ValueError, match="mean_output_tokens"):
        CacheSummary("r", 1, 0.0, 4, frozenset(), mean_output_tokens=-1.0)


def test_compact_timestamp_is_kept_to_the_millisecond():
    summary = CacheSummary("r", 1, 1234.56789012, 4, frozenset({5}))
    assert CacheSummary.from_dict(summary.to_dict()).timestamp_s == 1234.568
    assert CacheSummary.from_dict(summary.to_dict(compact=False)) == summary  # v1 keeps every digit


def test_fetch_costs_round_trip_and_an_older_worker_reads_as_unmeasured():
    from cache.summary import rounded_rate

    radix = RadixCache(1000, 4)
    summary = CacheSummary.from_radix(radix, 4, replica_id="r", version=1, timestamp_s=0.0,
                                      fetch_token_cost=rounded_rate(0.10485760000001), fetch_overhead_tokens=20.0)
    assert summary.fetch_token_cost == 0.105
    wire = summary.to_dict()
    assert (wire["fc"], wire["fo"]) == (0.105, 20.0) and len(json.dumps({"fc": wire["fc"]})) < 14
    assert CacheSummary.from_dict(wire) == summary
    assert CacheSummary.from_dict(summary.to_dict(compact=False)) == summary
    for old in (summary.to_dict(), summary.to_dict(compact=False)):
        for key in ("fc", "fo", "fetch_token_cost", "fetch_overhead_tokens"):
            old.pop(key, None)  # a worker from before the fields
        read = CacheSummary.from_dict(old)
        assert (read.fetch_token_cost, read.fetch_overhead_tokens) == (0.0, 0.0)
    with pytest.raises(ValueError, match="fetch_token_cost"):
        CacheSummary("r", 1, 0.0, 4, frozenset(), fetch_token_cost=-0.5)


def test_busy_time_round_trips_to_the_millisecond_and_an_older_worker_reads_as_zero():
    radix = RadixCache(1000, 4)
    summary = CacheSummary.from_radix(radix, 4, replica_id="r", version=1, timestamp_s=0.0, busy_s_total=1234.567)
    wire = summary.to_dict()
    assert wire["bu"] == 1234.567
    assert CacheSummary.from_dict(wire) == summary == CacheSummary.from_dict(summary.to_dict(compact=False))
    for old in (summary.to_dict(), summary.to_dict(compact=False)):
        old.pop("bu", None)
        old.pop("busy_s_total", None)  # a worker from before the field
        assert CacheSummary.from_dict(old).busy_s_total == 0.0
    assert "bu" not in CacheSummary.from_radix(radix, 4, replica_id="r", version=1, timestamp_s=0.0).to_dict()
    with pytest.raises(ValueError, match="busy_s_total"):
        CacheSummary("r", 1, 0.0, 4, frozenset(), busy_s_total=-1.0)


def test_the_prefill_in_progress_round_trips_and_an_older_worker_reads_as_zero():
    radix = RadixCache(1000, 4)
    summary = CacheSummary.from_radix(radix, 4, replica_id="r", version=1, timestamp_s=0.0, num_prefilling_tokens=3000)
    assert summary.to_dict()["pf"] == 3000
    assert CacheSummary.from_dict(summary.to_dict()) == summary == CacheSummary.from_dict(summary.to_dict(compact=False))
    for old in (summary.to_dict(), summary.to_dict(compact=False)):
        old.pop("pf", None)
        old.pop("num_prefilling_tokens", None)  # a worker from before the field
        assert CacheSummary.from_dict(old).num_prefilling_tokens == 0
    with pytest.raises(ValueError, match="num_prefilling_tokens"):
        CacheSummary("r", 1, 0.0, 4, frozenset(), num_prefilling_tokens=-1)
