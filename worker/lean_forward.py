"""A lean forward over a Llama-style Hugging Face causal LM: the model's own
modules and weights, run layer by layer without transformers' per-call
machinery.

``LlamaForCausalLM.__call__`` wraps every call in decorators (kwarg
deprecation, output capture, config defaults), builds a causal mask the
paged attention never reads, and returns output dataclasses; each decoder
layer and attention goes through ``nn.Module.__call__`` and more wrappers.
:class:`LeanForward` does the same maths in a plain loop (embedding, RoPE
once per step, then per layer: norm, attention, residual, norm, MLP,
residual; final norm; ``lm_head`` on the wanted rows only) and calls each
module's ``forward`` directly. Attention still goes through transformers'
``AttentionInterface`` (the registered ``"kvroute_paged"`` function, with
the step as ``kvroute_step``).

Where worker/linear.py fused a layer's projections, the lean path also
does, bit for bit, what the fused forwards do, with fewer copies:

- RoPE of q and k is written head-major (``[1, heads, T, D]`` contiguous),
  so the attention function's K write into the pool reads it without a
  copy; the unsqueezed cos and signed sin are made once per step, not per
  layer;
- each residual add rides on the GEMM before it (o_proj, down_proj) as a
  oneDNN post-op where :func:`worker.linear.fused_add_is_exact`.

Every op is one the HF forward runs on the same values in the same order,
so the logits are the same bits; worker/runner.py checks that on probe
steps at load time and keeps HF's forward wherever they are not
(:func:`lean_forward_for` only says whether the model has the shape).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.linear import linear_add, signed_sin

LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def lean_forward_for(model: nn.Module) -> LeanForward | None:
    """A :class:`LeanForward` when ``model`` has a Llama-style layout
    (``model.model.{embed_tokens, layers, norm, rotary_emb}``, ``lm_head``,
    layers with the four standard parts), else ``None``."""
    inner = getattr(model, "model", None)
    if inner is None or getattr(model, "lm_head", None) is None:
        return None
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    if not all(all(hasattr(layer, part) for part in LAYER_PARTS) for layer in inner.layers):
        return None
    return LeanForward(model)


class LeanForward:
    """``forward(step) -> [num_logits, vocab]`` logits of a :class:`worker.step.StepBatch`."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = list(inner.layers[: model.config.get_text_config().num_hidden_layers])
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.attend = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]

    def forward(self, step) -> torch.Tensor:
        hidden = self.embed.forward(step.input_ids[None])  # [1, T, hidden]
        cos, sin = self.rotary.forward(hidden, step.position_ids[None])  # [1, T, D] each
        rope = _Rope(cos, sin)
        for layer in self.layers:
            attention = layer.self_attn
            x = layer.input_layernorm.forward(hidden)
            if hasattr(attention, "qkv_proj") and attention.rotate_in_one_pass:
                hidden = linear_add(attention.o_proj, self._fused_attention(attention, x, rope, step), hidden)
            else:
                out, _ = attention.forward(x, position_embeddings=(cos, sin), attention_mask=None, kvroute_step=step)
                hidden = hidden + out
            mlp = layer.mlp
            x = layer.post_attention_layernorm.forward(hidden)
            if hasattr(mlp, "gate_up_proj"):
                gate, up = mlp.gate_up_proj(x).split(mlp.intermediate, dim=-1)
                hidden = linear_add(mlp.down_proj, mlp.act_fn(gate) * up, hidden)
            else:
                hidden = hidden + mlp.forward(x)
        hidden = self.norm.forward(hidden)
        return self.lm_head.forward(hidden[:, step.logits_rows])[0]

    def _fused_attention(self, attention: nn.Module, x: torch.Tensor, rope: _Rope, step) -> torch.Tensor:
        """worker/linear.py's ``_fused_attention_forward`` (one-pass RoPE), q and k written head-major;
        returns the attention output ``[1, T, heads * D]`` before o_proj."""
        num_rows, head_dim = x.shape[1], attention.head_dim
        qkv = attention.qkv_proj(x).view(1, num_rows, -1, head_dim)  # [1, T, heads + 2 kv_heads, D]
        num_q, num_k = attention.qkv_sizes[0] // head_dim, attention.qkv_sizes[1] // head_dim
        qk = rope.rotate_head_major(qkv[:, :, : num_q + num_k])  # [1, heads + kv_heads, T, D] contiguous
        value = qkv[:, :, num_q + num_k :].transpose(1, 2)
        out, _ = self.attend(attention, qk[:, :num_q], qk[:, num_q:], value, None, dropout=0.0,
                             scaling=attention.scaling, kvroute_step=step)
        return out.reshape(1, num_rows, -1)


class _Rope:
    """One step's cos and signed sin, shaped for ``[1, T, heads, D]`` once for every layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos = cos.unsqueeze(-2)  # [1, T, 1, D]
        self.signed_sin = signed_sin(sin).unsqueeze(-2)
        self.half = cos.shape[-1] // 2

    def rotate_head_major(self, x: torch.Tensor) -> torch.Tensor:
        """``worker.linear.rotate_heads(x, cos, sin)`` (HF's ``x * cos + rotate_half(x) * sin``,
        same ops, same bits) of ``x [1, T, heads, D]``, returned as ``[1, heads, T, D]`` contiguous."""
        half = self.half
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        out = x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3])  # [1, heads, T, D]
        rows = out.transpose(1, 2)  # the same memory as [1, T, heads, D]
        torch.mul(x, self.cos, out=rows)
        rows.add_(swapped * self.signed_sin)
        return out
