"""What the router needs to know about a request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """The routing attributes of one request (the ingress builds it; it also
    works with any object carrying the same attribute names).

    ``block_hashes``: ``cache.block_hashes(prompt_tokens, block_size, salt)`` at
    the router's block size: chained, salted, one per full block.
    ``num_prompt_tokens``: prompt length in tokens (>= the hashed part).
    ``salt``: tenant (already folded into the hashes; kept for logs).
    ``prompt``: the prompt as text, so text-based routers (Ray Serve LLM's
    PrefixCacheAffinityRouter) can run on the same requests.
    ``num_output_tokens``: expected decode length (e.g. ``max_new_tokens``);
    0 when unknown. Only weighs the load the request adds.
    ``token_ids``: the prompt's token ids (the hashed blocks and the partial
    last block), or ``()``. Optional: with them the router also matches
    within a block (:mod:`router.partial_blocks`), so a chat's next turn
    finds the replica holding its previous turn's partial last block.
    """

    block_hashes: tuple[int, ...]
    num_prompt_tokens: int
    salt: str | None = None
    prompt: str = ""
    num_output_tokens: int = 0
    token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.block_hashes, tuple):
            raise ValueError(f"block_hashes must be a tuple of ints, got {type(self.block_hashes).__name__}")
        if any(type(h) is not int for h in self.block_hashes):
            bad = next(h for h in self.block_hashes if type(h) is not int)
            raise ValueError(f"block_hashes must hold ints, got {bad!r}")
        for name in ("num_prompt_tokens", "num_output_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.salt is not None and not isinstance(self.salt, str):
            raise ValueError(f"salt must be a str or None, got {self.salt!r}")
        if not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be a str, got {type(self.prompt).__name__}")
        if not isinstance(self.token_ids, tuple):  # elements are checked where hashed, O(block)
            raise ValueError(f"token_ids must be a tuple of ints, got {type(self.token_ids).__name__}")

    @classmethod
    def from_object(cls, obj: object) -> RoutingRequest:
        """Read the routing attributes off any request object (duck-typed).

        Raises ``ValueError`` naming what is missing or malformed.
        """
        if isinstance(obj, RoutingRequest):
            return obj
        try:
            block_hashes = obj.block_hashes  # type: ignore[attr-defined]
            num_prompt_tokens = obj.num_prompt_tokens  # type: ignore[attr-defined]
        except AttributeError as error:
            raise ValueError(f"request {type(obj).__name__} has no routing attributes: {error}") from None
        try:
            hashes = tuple(block_hashes)
        except TypeError:
            raise ValueError(f"block_hashes must be a sequence of ints, got {block_hashes!r}") from None
        # The text is only needed to place prompts shorter than one block;
        # building it for long prompts costs O(tokens) for nothing.
        prompt = "" if hashes else getattr(obj, "prompt", "")
        token_ids = getattr(obj, "token_ids", ())
        return cls(
            block_hashes=hashes,
            num_prompt_tokens=num_prompt_tokens,
            salt=getattr(obj, "salt", None),
            prompt=prompt if isinstance(prompt, str) else "",
            num_output_tokens=getattr(obj, "num_output_tokens", 0) or 0,
            token_ids=token_ids if isinstance(token_ids, tuple) else (),
        )
