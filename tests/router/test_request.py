"""router.RoutingRequest: validated fields, duck-typed reading of request objects."""

from dataclasses import dataclass

import pytest

from router import RoutingRequest


@dataclass
class IngressRequest:
    block_hashes: tuple
    num_prompt_tokens: int
    salt: str | None = None

    @property
    def prompt(self):
        raise AssertionError("the text of a long prompt must not be built")


def test_reads_any_object_with_the_routing_attributes():
    request = RoutingRequest.from_object(IngressRequest((1, 2), 40, "t"))
    assert request == RoutingRequest((1, 2), 40, "t", "", 0)


def test_a_routing_request_passes_through():
    request = RoutingRequest((5,), 16)
    assert RoutingRequest.from_object(request) is request


def test_text_is_read_only_for_prompts_shorter_than_a_block():
    class Short:
        block_hashes = ()
        num_prompt_tokens = 3
        prompt = "abc"

    assert RoutingRequest.from_object(Short()).prompt == "abc"


@pytest.mark.parametrize("obj, message", [
    (None, "no routing attributes"),
    (object(), "no routing attributes"),
    (IngressRequest(5, 10), "block_hashes"),
    (IngressRequest(("x",), 10), "block_hashes"),
    (IngressRequest((1,), -1), "num_prompt_tokens"),
    (IngressRequest((1,), True), "num_prompt_tokens"),
    (IngressRequest((1,), 10, salt=3), "salt"),
])
def test_malformed_requests_raise_value_error_naming_the_field(obj, message):
    with pytest.raises(ValueError, match=message):
        RoutingRequest.from_object(obj)


def test_fields_are_validated_on_construction():
    with pytest.raises(ValueError, match="block_hashes"):
        RoutingRequest([1, 2], 10)
    with pytest.raises(ValueError, match="num_output_tokens"):
        RoutingRequest((1,), 10, num_output_tokens=-2)
    with pytest.raises(ValueError, match="prompt"):
        RoutingRequest((1,), 10, prompt=b"x")


def test_token_ids_are_read_when_they_are_a_tuple():
    class WithTokens:
        block_hashes = (1,)
        num_prompt_tokens = 5
        token_ids = (1, 2, 3, 4, 5)

    assert RoutingRequest.from_object(WithTokens()).token_ids == (1, 2, 3, 4, 5)
    WithTokens.token_ids = [1, 2, 3, 4, 5]  # not a tuple: ignored (no copy of a long list per decision)
    assert RoutingRequest.from_object(WithTokens()).token_ids == ()


def test_token_ids_must_be_a_tuple():
    with pytest.raises(ValueError, match="token_ids"):
        RoutingRequest((1,), 5, token_ids=[1, 2])
