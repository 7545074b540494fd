"""Loading the causal LM and its tokenizer.

``"tiny-llama"`` builds a randomly initialised ``LlamaForCausalLM`` from
:class:`TinyLlamaSpec` with a fixed seed, so every process (every replica)
holds bit-identical weights without downloading anything; its tokenizer is
byte-level (transformers' ``ByT5Tokenizer``: pad 0, eos 1, unk 2, byte ``b`` is
``b + 3``) with a small chat template. Any other name is a local path or hub
id loaded with ``AutoModelForCausalLM`` / ``AutoTokenizer``; the model must
route attention through transformers' ``AttentionInterface`` (Llama, Qwen2,
Mistral and most recent decoder-only families do).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """Shape of the built-in random Llama (GQA: ``num_heads`` query heads share
    ``num_kv_heads`` key/value heads). The vocabulary is the byte tokenizer's
    (259) unless ``vocab_size`` is set (benchmarks: ids past 258 have no text)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    seed: int = 0
    vocab_size: int | None = None  # None: the byte tokenizer's 259

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"TinyLlamaSpec.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.vocab_size is not None and (type(self.vocab_size) is not int or self.vocab_size < 259):
            raise ValueError(f"vocab_size must be None or an int >= 259, got {self.vocab_size!r}")
        if type(self.max_position_embeddings) is not int or self.max_position_embeddings < 2:
            raise ValueError(f"max_position_embeddings must be an int >= 2, got {self.max_position_embeddings!r}")


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What the KV pool needs to know about the model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module  # eval mode, on the target device, attention routed to the paged kernel
    tokenizer: object  # a transformers tokenizer
    model_id: str
    vocab_size: int  # rows of the output logits
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    geometry: KVGeometry


def byte_tokenizer():
    """The tiny model's tokenizer: bytes + (pad, eos, unk), with a chat template.

    Unlike ByT5 (an encoder-decoder tokenizer), it appends no EOS when
    encoding: a prompt ends where its text ends.
    """
    from transformers import ByT5Tokenizer

    class ByteTokenizer(ByT5Tokenizer):
        def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
            return list(token_ids_0) + list(token_ids_1 or [])

        def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False):
            if already_has_special_tokens:
                return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
            return [0] * (len(token_ids_0) + len(token_ids_1 or []))

        def create_token_type_ids_from_sequences(self, token_ids_0, token_ids_1=None):
            return [0] * (len(token_ids_0) + len(token_ids_1 or []))

    tokenizer = ByteTokenizer(extra_ids=0)
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


def portable_byte_tokenizer():
    """:func:`byte_tokenizer` as a plain ``ByT5Tokenizer``, for saving where
    others load it (``AutoTokenizer.from_pretrained`` without kvroute): the
    same ids and chat template, but encoding appends the EOS id as ByT5 does."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer(extra_ids=0)
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(name: str, *, trust_remote_code: bool = False):
    """The tokenizer of model ``name`` without loading its weights (for an ingress)."""
    if name == "tiny-llama":
        return byte_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def model_info(name: str, engine_kwargs: Mapping[str, Any] | None = None) -> dict:
    """What an ingress validates against, from the config alone (no weights):
    ``vocab_size``, ``max_model_len``, ``eos_token_id``. ``engine_kwargs`` are
    ``EngineConfig`` keyword arguments (``max_model_len``, ``tiny_llama``)."""
    engine_kwargs = dict(engine_kwargs or {})
    if name == "tiny-llama":
        spec = engine_kwargs.get("tiny_llama") or TinyLlamaSpec()
        if isinstance(spec, Mapping):
            spec = TinyLlamaSpec(**spec)
        vocab_size, context, eos = spec.vocab_size or len(byte_tokenizer()), spec.max_position_embeddings, (1,)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            name, trust_remote_code=bool(engine_kwargs.get("trust_remote_code", False))
        ).get_text_config()
        vocab_size = config.vocab_size
        context = int(getattr(config, "max_position_embeddings", 2048))
        eos_value = config.eos_token_id
        eos = () if eos_value is None else ((eos_value,) if isinstance(eos_value, int) else tuple(eos_value))
    max_model_len = engine_kwargs.get("max_model_len") or context
    return {
        "model_id": name,
        "vocab_size": vocab_size,
        "max_model_len": min(max_model_len, context),
        "eos_token_id": eos[0] if eos else None,
        "eos_token_ids": list(eos),
    }


def build_tiny_llama(spec: TinyLlamaSpec, vocab_size: int) -> nn.Module:
    """A seeded random ``LlamaForCausalLM`` (float32, CPU); same weights in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    return model


def load_model(
    name: str,
    spec: TinyLlamaSpec,
    *,
    device: str,
    dtype: str,
    attn_implementation: str,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load ``name`` (or build tiny-llama) with attention routed to ``attn_implementation``."""
    torch_dtype = getattr(torch, dtype)
    if name == "tiny-llama":
        tokenizer = byte_tokenizer()
        model = build_tiny_llama(spec, vocab_size=spec.vocab_size or len(tokenizer))
        model.set_attn_implementation(attn_implementation)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch_dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    model = model.to(device=device, dtype=torch_dtype).eval()
    model.requires_grad_(False)
    config = model.config.get_text_config()
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    geometry = KVGeometry(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        num_heads=num_heads,
    )
    eos = _eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=name,
        vocab_size=vocab_size,
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_ids=eos,
        pad_token_id=int(pad),
        geometry=geometry,
    )


def _eos_token_ids(model: nn.Module, tokenizer) -> tuple[int, ...]:
    candidates = []
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), model.config.get_text_config().eos_token_id):
        if source is not None:
            candidates = [source] if isinstance(source, int) else list(source)
            break
    if not candidates and tokenizer.eos_token_id is not None:
        candidates = [tokenizer.eos_token_id]
    return tuple(int(token) for token in candidates)
