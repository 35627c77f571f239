"""Toy Qwen3.5 text model (flax NNX): Gated DeltaNet layers and gated full-attention layers.

Computes exactly what Hugging Face ``Qwen3_5ForCausalLM`` computes (transformers >= 5):

Layers live in :mod:`kvjax.models.qwen3_5_layers`; this module holds the config, caches, model and loader.

- ``linear_attention`` layers (:class:`GatedDeltaNet`): ``in_proj_qkv`` -> causal depthwise conv1d + SiLU over
  the concatenated ``[q | k | v]`` -> gated delta rule with q/k l2-norm, ``g = -exp(A_log) * softplus(a +
  dt_bias)``, ``beta = sigmoid(b)`` -> per-head gated RMSNorm with ``z`` -> ``out_proj``;
- ``full_attention`` layers (:class:`GatedAttention`): ``q_proj`` gives per head ``[q | gate]``; zero-centred
  RMSNorm on q and k per head; partial NeoX RoPE; GQA softmax attention; output ``* sigmoid(gate)``; ``o_proj``;
- every layer: pre-norm residual token mixer and SwiGLU MLP; zero-centred RMSNorms (``1 + weight``).

Two forward paths share the same parameters:

- :meth:`Qwen3_5ForCausalLM.logits` — full sequences ``i32[B, T]``, no cache: the oracle for everything cached;
- :meth:`Qwen3_5ForCausalLM.forward_step` — one ragged step (:class:`kvjax.engine.inputs.StepInputs`) on the
  caches (:class:`Qwen3_5Caches`): GDN states by slot id, K/V in head-wise paged pools (jitted by
  :mod:`kvjax.engine.step`).

Build: :func:`kvjax.models.load_pretrained` (HF checkpoint), :func:`init_random` (toy weights), and
:meth:`Qwen3_5ForCausalLM.with_swa` (same weights, SWA heads).

Research option (off by default): ``Qwen3_5Config.attention.window/sinks`` make some KV heads of every
full-attention layer sliding-window heads (mask: ``j <= i`` and (``i - j < window`` or ``j < sinks``)); both
paths apply the same mask. HF has no such heads, so parity with HF holds only with the option off.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.config import AttentionConfig, GDNConfig
from kvjax.errors import CheckpointError
from kvjax.models.common import (
    Linear, TensorSource, abstract_model, assign_params, config_get, load_safetensors, rope_cos_sin, rope_inv_freq,
)
from kvjax.models.qwen3_5_layers import TextModel
from kvjax.state import gdn_pool
from kvjax.state.gdn_pool import GDNStatePool
from kvjax.state.registry import GQACacheSpec, cache_name, create_caches

LAYER_TYPES = ("linear_attention", "full_attention")


# ---------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config:
    """Static shape config of the text model (hashable: it is part of the jit-static graph)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    attention: AttentionConfig  # full-attention layers (window/sinks: SWA heads, research option)
    gdn: GDNConfig  # linear-attention layers
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Qwen3_5Config.{name} must be an int >= 1, got {v!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if not self.layer_types:
            raise ValueError("Qwen3_5Config.layer_types is empty")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"Qwen3_5Config.layer_types has unknown entries {bad}; allowed {LAYER_TYPES}")
        rotary = int(self.attention.head_dim * self.partial_rotary_factor)
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"rotary dim int(head_dim={self.attention.head_dim} * partial_rotary_factor="
                f"{self.partial_rotary_factor}) = {rotary} must be even and >= 2"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def with_swa(self, window: tuple[int, ...], sinks: tuple[int, ...] = ()) -> "Qwen3_5Config":
        """Same model with per-KV-head ``window``/``sinks`` in every full-attention layer (research option)."""
        a = self.attention
        return dataclasses.replace(
            self, attention=AttentionConfig(a.num_q_heads, a.num_kv_heads, a.head_dim, window=window, sinks=sinks)
        )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Qwen3_5Config":
        """From an HF ``config.json`` dict (``qwen3_5_text``, or ``qwen3_5`` whose ``text_config`` is used).

        Raises :class:`CheckpointError` naming the missing or invalid key.
        """
        if cfg.get("model_type") == "qwen3_5" or "text_config" in cfg:
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise CheckpointError(f"qwen3_5 config needs a 'text_config' object, got {text!r}")
            outer_tie = cfg.get("tie_word_embeddings")  # the wrapper's flag governs its lm_head
            cfg = text if outer_tie is None else {**text, "tie_word_embeddings": outer_tie}
        try:
            act = config_get(cfg, "hidden_act", "silu", kind=str)
            if act != "silu":
                raise CheckpointError(f"config hidden_act={act!r} is not supported (only 'silu')")
            n_layers = config_get(cfg, "num_hidden_layers", kind=int)
            layer_types = cfg.get("layer_types")
            if layer_types is None:
                interval = config_get(cfg, "full_attention_interval", 4, kind=int)
                layer_types = [
                    "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
                ]
            if not isinstance(layer_types, list) or len(layer_types) != n_layers:
                raise CheckpointError(
                    f"config layer_types must be a list of num_hidden_layers={n_layers} entries, got {layer_types!r}"
                )
            hidden = config_get(cfg, "hidden_size", kind=int)
            n_heads = config_get(cfg, "num_attention_heads", kind=int)
            rope = dict(cfg.get("rope_parameters") or {})
            rope_type = rope.get("rope_type", "default")
            if rope_type != "default":
                raise CheckpointError(f"config rope_parameters.rope_type={rope_type!r} is not supported")
            theta = rope.get("rope_theta", cfg.get("rope_theta"))
            if theta is None:
                raise CheckpointError("config has no rope_theta (rope_parameters.rope_theta)")
            prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
            return cls(
                vocab_size=config_get(cfg, "vocab_size", kind=int),
                hidden_size=hidden,
                intermediate_size=config_get(cfg, "intermediate_size", kind=int),
                layer_types=tuple(layer_types),
                attention=AttentionConfig(
                    n_heads,
                    config_get(cfg, "num_key_value_heads", kind=int),
                    config_get(cfg, "head_dim", hidden // n_heads, kind=int),
                ),
                gdn=GDNConfig(
                    config_get(cfg, "linear_num_key_heads", kind=int),
                    config_get(cfg, "linear_num_value_heads", kind=int),
                    config_get(cfg, "linear_key_head_dim", kind=int),
                    config_get(cfg, "linear_value_head_dim", kind=int),
                    config_get(cfg, "linear_conv_kernel_dim", 4, kind=int),
                ),
                rms_norm_eps=float(config_get(cfg, "rms_norm_eps", 1e-6, kind=(int, float))),
                rope_theta=float(theta),
                partial_rotary_factor=float(prf),
                attention_bias=bool(config_get(cfg, "attention_bias", False, kind=bool)),
                tie_word_embeddings=bool(config_get(cfg, "tie_word_embeddings", False, kind=bool)),
            )
        except CheckpointError:
            raise
        except ValueError as err:  # a kvjax config rejected a value
            raise CheckpointError(f"invalid Qwen3.5 config: {err}") from err


# ---------------------------------------------------------------------------------------------- caches


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen3_5Caches:
    """Device state of a Qwen3.5 model (donated to and returned by the step).

    ``gdn``: the GDN state pool of the linear-attention layers (pool layer ``i`` = ``i``-th GDN layer; slot 0 =
    PAD, never written). ``kv``: the cache registry's ``{key_caches_<layer>, value_caches_<layer>}`` single-head
    page pools ``[P, page_size, D]`` of each full-attention layer (``<layer>`` = model layer index).
    """

    gdn: GDNStatePool  # conv [L_gdn, S+1, conv_dim, W-1], ssm f32[L_gdn, S+1, Hv, K, V]
    kv: dict  # {"key_caches_<l>" / "value_caches_<l>": [P, page_size, D]}


# ---------------------------------------------------------------------------------------------- model


class Qwen3_5ForCausalLM(nnx.Module):
    """Toy Qwen3.5 text model. Parameter paths mirror HF names (``kernel`` = transposed ``weight``)."""

    def __init__(self, config: Qwen3_5Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.model = TextModel(config, rngs=rngs, dtype=dtype)
        self.lm_head = (
            None if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, rngs=rngs, dtype=dtype)
        )
        inv_freq, _ = rope_inv_freq(
            config.attention.head_dim,
            {"rope_theta": config.rope_theta, "partial_rotary_factor": config.partial_rotary_factor},
        )
        self._inv_freq = tuple(float(f) for f in inv_freq)  # static, f32-exact

    def with_swa(self, window: tuple[int, ...], sinks: tuple[int, ...] = ()) -> "Qwen3_5ForCausalLM":
        """A model with the same parameters whose full-attention layers have per-KV-head ``window``/``sinks``
        (research option: SWA heads). Both :meth:`logits` and :meth:`forward_step` apply the new masks."""
        config = self.config.with_swa(tuple(window), tuple(sinks))
        graphdef, _ = nnx.split(abstract_model(lambda: Qwen3_5ForCausalLM(config, rngs=nnx.Rngs(0))))
        return nnx.merge(graphdef, nnx.state(self))

    def _head(self, h: jax.Array) -> jax.Array:  # [..., H] -> f32[..., vocab]
        h = self.model.norm(h)
        if self.lm_head is None:
            out = jnp.matmul(h, self.model.embed_tokens[...].T, precision=jax.lax.Precision.HIGHEST)
        else:
            out = self.lm_head(h)
        return out.astype(jnp.float32)

    def _cos_sin(self, positions: jax.Array):
        return rope_cos_sin(positions, jnp.asarray(self._inv_freq, jnp.float32))

    def logits(self, input_ids: jax.Array) -> jax.Array:  # i32[B, T] -> f32[B, T, vocab]
        """Full-sequence forward without a cache (positions ``0..T-1``): the oracle for the cached step."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be i32[B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        x = self.model.embed_tokens[...][input_ids]  # [B, T, H]
        cos, sin = self._cos_sin(jnp.arange(t, dtype=jnp.int32))
        cu = jnp.arange(b + 1, dtype=jnp.int32) * t
        for layer in self.model.layers:
            h = layer.input_layernorm(x)
            if layer.layer_type == "linear_attention":
                y = layer.linear_attn(h.reshape(b * t, -1), cu)
                y = y.reshape(b, t, -1)
            else:
                y = layer.self_attn.full(h, cos, sin)
            x = layer.mlp_block(x + y)
        return self._head(x)

    # ------------------------------------------------------------------------------------------ cached

    def init_caches(self, *, num_pages: int, page_size: int, max_seqs: int, dtype=jnp.float32) -> Qwen3_5Caches:
        """Zeroed caches: a GDN pool with ``max_seqs + 1`` slots (slot 0 = PAD), ``num_pages`` K/V pages per
        attention layer (page/conv dtype ``dtype``; SSM state always f32)."""
        c = self.config
        a = c.attention
        specs = [GQACacheSpec(layer=i, num_kv_heads=a.num_kv_heads, page_size=page_size, head_dim=a.head_dim,
                              dtype=dtype) for i in c.attention_layers]
        return Qwen3_5Caches(
            gdn=gdn_pool.create(c.gdn, len(c.gdn_layers), max_seqs, conv_dtype=dtype),
            kv=create_caches(specs, num_pages),
        )

    def forward_step(self, caches: Qwen3_5Caches, inputs) -> tuple[jax.Array, Qwen3_5Caches]:
        """One ragged step (prefill chunks and decode tokens mixed); returns ``(f32[B, vocab], new caches)``.

        Reads and writes GDN states at ``inputs.gdn_slots`` (zeros where ``has_initial_state`` is false; slot 0
        never written), writes new K/V by ``inputs.slot_mapping`` and attends through ``inputs.block_tables``
        with the per-KV-head window/sinks. ``inputs.decode_only`` (static) selects the recurrent GDN kernel and
        the conv update; otherwise the chunked kernel serves every row (prefill chunks and decode tokens).
        """
        from kvjax.ops.attention import paged_attention
        from kvjax.state.kv_cache import write_kv

        c = self.config
        x = self.model.embed_tokens[...][inputs.token_ids]  # [T, H]
        cos, sin = self._cos_sin(inputs.positions)
        window = jnp.asarray(c.attention.window, jnp.int32)
        sinks = jnp.asarray(c.attention.sinks, jnp.int32)
        pool, kv = caches.gdn, dict(caches.kv)
        if inputs.decode_only:  # decode kernels continue every live row: zero fresh rows' slots (1-token prompts)
            pool = gdn_pool.reset(pool, jnp.where(inputs.has_initial_state, 0, inputs.gdn_slots))
        gi = 0
        for li, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            if layer.layer_type == "linear_attention":
                y, pool = layer.linear_attn.step(h, inputs, pool, gi, inputs.decode_only)
                gi += 1
            else:
                attn = layer.self_attn
                q, gate, k, v = attn.project(h, cos, sin)
                kname, vname = cache_name("key", li), cache_name("value", li)
                kv[kname], kv[vname] = write_kv(kv[kname], kv[vname], k, v, inputs.slot_mapping)
                o = paged_attention(
                    q, kv[kname], kv[vname], inputs.block_tables, inputs.seq_lens, cu_seqlens=inputs.cu_seqlens,
                    scale=c.attention.head_dim ** -0.5, window=window, sinks=sinks,
                )
                y = attn.finish(o, gate)
            x = layer.mlp_block(x + y)
        logits = self._head(x[inputs.logits_indices])
        return logits, Qwen3_5Caches(gdn=pool, kv=kv)


# ---------------------------------------------------------------------------------------------- loading


def init_random(config: Qwen3_5Config, *, seed: int = 0, dtype=jnp.float32) -> Qwen3_5ForCausalLM:
    """A randomly initialised model, drawn on the host with numpy (fast: no per-shape device compiles).

    Same distributions as the module constructors / HF init: projections ``N(0, 1/fan_in)``, embeddings
    ``N(0, 0.02^2)``, ``A_log = log U(0.01, 16)``, ``dt_bias = 1``, zero-centred norms 0, gated norm 1.
    """
    model = abstract_model(lambda: Qwen3_5ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype))
    rng = np.random.default_rng(seed)
    values = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape, last = tuple(var.get_value().shape), str(path[-1])
        if last == "kernel":
            values[path] = rng.normal(0.0, 1.0 / np.sqrt(shape[0]), shape)
        elif last == "conv_weight":
            values[path] = rng.normal(0.0, 1.0 / np.sqrt(shape[1]), shape)
        elif last == "embed_tokens":
            values[path] = rng.normal(0.0, 0.02, shape)
        elif last == "A_log":
            values[path] = np.log(rng.uniform(0.01, 16.0, shape))
        elif last == "dt_bias" or path[-3:] == ("linear_attn", "norm", "weight"):
            values[path] = np.ones(shape)
        else:  # biases and zero-centred RMSNorm scales
            values[path] = np.zeros(shape)
    return assign_params(model, values)


def from_hf_config(cfg: dict[str, Any], *, seed: int = 0, dtype=jnp.float32) -> Qwen3_5ForCausalLM:
    """A randomly initialised model of the shape an HF config dict describes."""
    return init_random(Qwen3_5Config.from_hf(cfg), seed=seed, dtype=dtype)


def _hf_name(path: tuple) -> tuple[str, bool]:
    """HF tensor name of an nnx parameter path and whether the value is transposed (``kernel``)."""
    parts = [str(p) for p in path]
    if parts[-1] == "kernel":
        return ".".join(parts[:-1] + ["weight"]), True
    if parts[-1] == "conv_weight":
        return ".".join(parts[:-1] + ["conv1d", "weight"]), False
    if parts == ["model", "embed_tokens"]:
        return "model.embed_tokens.weight", False
    return ".".join(parts), False


def load(path: str | os.PathLike, config: dict[str, Any], *, dtype=jnp.float32, window: tuple[int, ...] = (),
         sinks: tuple[int, ...] = ()) -> Qwen3_5ForCausalLM:
    """Load an HF Qwen3.5 checkpoint directory (``Qwen3_5ForCausalLM`` or the text tower of the multimodal
    ``Qwen3_5ForConditionalGeneration``). Raises :class:`CheckpointError` naming a missing, mis-shaped or
    unexpected tensor; the model is returned only when every parameter is loaded. ``window``/``sinks``
    (per KV head) turn on SWA heads in the full-attention layers (research option; HF parity needs them off)."""
    cfg = Qwen3_5Config.from_hf(config)
    if window or sinks:
        try:
            cfg = cfg.with_swa(tuple(window), tuple(sinks))
        except ValueError as err:
            raise CheckpointError(f"invalid SWA option: {err}") from err
    tensors = load_safetensors(path)
    model = abstract_model(lambda: Qwen3_5ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    renamed = {}
    for name, value in tensors.items():
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        renamed[name] = value
    src = TensorSource(renamed)
    values = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transposed = _hf_name(p)
        shape = tuple(var.get_value().shape)
        if name.endswith("conv1d.weight"):
            values[p] = src.take(name, (shape[0], 1, shape[1])).reshape(shape)
        elif transposed:
            values[p] = src.take(name, shape[::-1]).T
        else:
            values[p] = src.take(name, shape)
    extra = src.unused(ignore_prefixes=("mtp.", "model.visual.", "model.mtp."))
    if model.config.tie_word_embeddings:
        extra = [e for e in extra if e != "lm_head.weight"]
    if extra:
        raise CheckpointError(f"checkpoint has tensors the config does not describe: {extra[:8]}")
    return assign_params(model, values)
