"""worker.messages: what the ingress sends carries every routing attribute."""

from cache import block_hashes
from router import RoutingRequest
from worker import SamplingParams
from worker.messages import WorkerBatch, WorkerRequest, tokens_as_text


def make_request(tokens, request_id="r1"):
    return WorkerRequest(request_id, tuple(tokens), SamplingParams(max_new_tokens=7), "tenant",
                         tuple(block_hashes(tokens, 4, "tenant")))


def test_a_request_routes_with_its_hashes_tokens_and_decode_length():
    request = make_request(range(10))
    routing = RoutingRequest.from_object(request)
    assert routing.block_hashes == request.block_hashes and len(routing.block_hashes) == 2
    assert routing.num_prompt_tokens == 10 and routing.num_output_tokens == 7
    assert routing.token_ids == tuple(range(10)) and routing.salt == "tenant"


def test_a_batch_routes_like_its_shared_prefix():
    shared = tuple(range(6))
    requests = (make_request(shared + (50,), "a"), make_request(shared + (60, 61), "b"))
    batch = WorkerBatch(requests, tuple(block_hashes(shared, 4, "tenant")), shared, "tenant")
    routing = RoutingRequest.from_object(batch)
    assert routing.token_ids == shared
    assert routing.num_prompt_tokens == 15 and routing.num_output_tokens == 14
    assert batch.prompt == tokens_as_text(shared)
