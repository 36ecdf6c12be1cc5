"""Qwen3-MoE, end to end: embedding, decoder layers, final norm, lm_head; greedy generation
over a paged KV cache.

One decoder layer (transformers' ``Qwen3MoeDecoderLayer``)::

    h = h + attention(rms_norm(h, input_layernorm))          # QK-norm, RoPE, paged KV cache
    h = h + mlp(rms_norm(h, post_attention_layernorm))       # MoE, or a dense SwiGLU MLP

Layer ``i`` is an MoE layer iff ``i not in mlp_only_layers and num_experts > 0 and
(i + 1) % decoder_sparse_step == 0`` (transformers' rule); the others run a dense MLP of width
``intermediate_size``. The lm_head is ``lm_head.weight``, or the embedding when
``tie_word_embeddings``.

Generation (``Qwen3MoE.generate``), greedy:

* Prompts of different lengths are **right-padded**: row ``b`` holds its ``lengths[b]`` real
  tokens first, then padding (any id; ignored). Every row keeps its own positions (0, 1, ...),
  so a prompt gives the same tokens alone and in a batch.
* The batch is padded to a power of two ``Bp`` (dummy rows of one pad token) and the prompt to
  a power of two ``Sp >= 32``; each layer gets a ``PagedKVCache`` of ``Bp * Pt`` pages of 16
  tokens, ``Pt`` = the pages the longest row needs (prompt + new tokens) rounded up to a power
  of two, at least 4. Each sequence is allocated the pages it needs from that pool (its block
  table row).
* One jitted prefill (creates the caches, writes the prompts, returns the first new token),
  then ONE jitted decode step (embed the last token, every layer, argmax) called once per new
  token; it donates the caches (updated in place). Both compile once per
  ``(Bp, Sp, Pt)`` / ``(Bp, Pt)`` bucket and static config; ``TRACES`` counts the traces.
  With ``max_seq_len`` set, ``Pt`` is fixed: the decode step compiles once per batch bucket.
* Generation does not stop at EOS: it returns exactly ``max_new_tokens`` tokens a row.

The model calls the attention layer's unchecked step (``attention.layer.attention_step``): the
block tables are built here, valid by construction, so the public entry points' host-side
checks (a device-to-host callback per layer) would only cost time on every token.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.attention.kv_cache import PagedKVCache
from atlas_jax.attention.layer import attention_step, linear
from atlas_jax.attention.norm import add_rms_norm, rms_norm
from atlas_jax.attention.params import AttentionParams
from atlas_jax.checkpoint import Checkpoint, load_attention_layer, load_moe_layer
from atlas_jax.config import ActQuant, Format, KernelConfig, KVDtype, MoEConfig, _text_config
from atlas_jax.moe import MoEParams, moe_forward
from atlas_jax.ops.activation import GateUp, gated_activation
from atlas_jax.ops.grouped_matmul import compute_dtype
from atlas_jax.quant import QTensor, concat_rows, quantize
from atlas_jax.quant.stored import linear_from_tensors

__all__ = [
    "PAGE_SIZE",
    "TRACES",
    "DenseMLPParams",
    "GenerationTimes",
    "LayerParams",
    "Qwen3MoE",
    "Qwen3MoEConfig",
    "Qwen3MoEParams",
    "load",
    "load_params",
    "with_act_quant",
]

MODEL_TYPE = "qwen3_moe"
PAGE_SIZE = 16  # tokens per KV page
MIN_PROMPT_BUCKET = 32  # prompts are padded to a power of two >= this
MIN_CACHE_PAGES = 4  # block tables are a power of two >= this many pages a sequence

# Traces of the jitted steps ("forward", "prefill", "decode"): one per compiled variant.
TRACES: collections.Counter[str] = collections.Counter()


# ---- config and params --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Qwen3MoEConfig:
    """The model-level fields of a qwen3_moe config.json (the layers read their own configs)."""

    vocab_size: int  # V
    hidden_size: int  # H
    num_layers: int
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    intermediate_size: int  # width of the dense MLPs
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Qwen3MoEConfig.{name}: must be a positive int, got {value!r}")
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"Qwen3MoEConfig.moe_layers: expected {self.num_layers} entries, "
                             f"got {len(self.moe_layers)}")

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> Qwen3MoEConfig:
        text = _text_config(d)
        if text.get("model_type") != MODEL_TYPE:
            raise NotImplementedError(f"model_type {text.get('model_type')!r}: Qwen3MoEConfig "
                                      f"reads {MODEL_TYPE!r} configs only")
        n = int(text["num_hidden_layers"])
        experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
        mlp_only = set(text.get("mlp_only_layers") or [])
        step = int(text.get("decoder_sparse_step") or 1)
        moe = tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(n))
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_layers=n,
            moe_layers=moe,
            intermediate_size=int(text.get("intermediate_size") or 0),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseMLPParams:
    """A dense SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, gate|up fused (gate rows first)."""

    gate_up: QTensor  # [2I, H]
    down: QTensor  # [H, I]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    input_norm: jax.Array  # [H] input_layernorm
    attention: AttentionParams
    post_attention_norm: jax.Array  # [H] post_attention_layernorm
    mlp: MoEParams | DenseMLPParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen3MoEParams:
    embed: jax.Array  # [V, H] embed_tokens
    layers: tuple[LayerParams, ...]
    norm: jax.Array  # [H] final norm
    lm_head: QTensor | None  # [V, H]; None: tied to embed
    config: Qwen3MoEConfig = dataclasses.field(default=None, metadata=dict(static=True))  # type: ignore


# ---- the math -----------------------------------------------------------------------------------


def dense_mlp(p: DenseMLPParams, x: jax.Array) -> jax.Array:
    """``[..., H] -> [..., H]`` in x.dtype (float32 accumulation)."""
    h = linear(x, p.gate_up, None)  # [..., 2I] f32
    a = gated_activation(h, GateUp()).astype(compute_dtype(x))  # [..., I]
    return linear(a, p.down, None).astype(x.dtype)


def lm_head(params: Qwen3MoEParams) -> QTensor:
    if params.lm_head is not None:
        return params.lm_head
    return quantize(params.embed, Format.BF16, dtype=None)  # tied: a view of the embedding


def decoder_layer(layer: LayerParams, h: jax.Array, cache: PagedKVCache, tables: jax.Array,
                  start: jax.Array, n_valid: jax.Array, eps: float,
                  kernels: KernelConfig | None, decode: bool = False
                  ) -> tuple[jax.Array, PagedKVCache]:
    """One decoder layer on ``h [B, S, H]``; rows past ``n_valid[b]`` are padding. ``decode``:
    every row holds S real tokens (a decode step: the attention may use its decode kernel)."""
    a = rms_norm(h, layer.input_norm, eps)
    a, cache = attention_step(layer.attention, a, cache, tables, start, n_valid, None, kernels,
                              decode)
    m, h = add_rms_norm(a, h, layer.post_attention_norm, eps)  # h += attention
    if isinstance(layer.mlp, MoEParams):
        m = moe_forward(layer.mlp, m, kernels=kernels)
    else:
        m = dense_mlp(layer.mlp, m)
    return h + m, cache


def decoder(params: Qwen3MoEParams, ids: jax.Array, caches: tuple[PagedKVCache, ...],
            tables: jax.Array, start: jax.Array, n_valid: jax.Array,
            kernels: KernelConfig | None, decode: bool = False
            ) -> tuple[jax.Array, tuple[PagedKVCache, ...]]:
    """``ids [B, S]`` at positions ``start[b] + s`` -> final-normed hidden ``[B, S, H]``."""
    cfg = params.config
    h = params.embed[ids]  # [B, S, H]
    new = []
    for layer, cache in zip(params.layers, caches, strict=True):
        h, cache = decoder_layer(layer, h, cache, tables, start, n_valid, cfg.rms_norm_eps,
                                 kernels, decode)
        new.append(cache)
    return rms_norm(h, params.norm, cfg.rms_norm_eps), tuple(new)


def logits(params: Qwen3MoEParams, h: jax.Array) -> jax.Array:
    """``[..., H] -> [..., V]`` float32."""
    return linear(h, lm_head(params), None)


def new_caches(params: Qwen3MoEParams, num_pages: int,
               kv_dtype: KVDtype) -> tuple[PagedKVCache, ...]:
    return tuple(PagedKVCache.create(num_pages, PAGE_SIZE, layer.attention.config, kv_dtype)
                 for layer in params.layers)


@functools.partial(jax.jit, static_argnames=("num_pages", "kv_dtype", "kernels", "all_logits"))
def _prefill(params, ids, lengths, tables, *, num_pages, kv_dtype, kernels, all_logits):
    """Fresh caches, the prompts written. ``all_logits``: logits ``[B, S, V]`` (forward); else
    the greedy first new token ``[B]`` (generate) and the caches."""
    TRACES["forward" if all_logits else "prefill"] += 1
    b = ids.shape[0]
    caches = new_caches(params, num_pages, kv_dtype)
    h, caches = decoder(params, ids, caches, tables, jnp.zeros((b,), jnp.int32), lengths,
                        kernels)
    if all_logits:
        return logits(params, h)
    last = h[jnp.arange(b), lengths - 1]  # [B, H] the last real token of each row
    return jnp.argmax(logits(params, last), axis=-1).astype(jnp.int32), caches


@functools.partial(jax.jit, static_argnames=("kernels",), donate_argnames=("caches",))
def _decode(params, caches, tokens, positions, tables, *, kernels):
    """One greedy step: ``tokens [B]`` at ``positions [B]`` -> next tokens, caches, positions+1."""
    TRACES["decode"] += 1
    b = tokens.shape[0]
    h, caches = decoder(params, tokens[:, None], caches, tables, positions,
                        jnp.ones((b,), jnp.int32), kernels, decode=True)
    nxt = jnp.argmax(logits(params, h[:, 0]), axis=-1).astype(jnp.int32)
    return nxt, caches, positions + 1


# ---- paging -------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _tables(needed: np.ndarray, width: int) -> np.ndarray:
    """Block tables ``[B, width]``: sequence b gets ``needed[b]`` consecutive pages of the pool;
    entries past them are unused (0, never read unmasked)."""
    tables = np.zeros((len(needed), width), np.int32)
    offset = 0
    for b, n in enumerate(needed):
        tables[b, :n] = np.arange(offset, offset + n)
        offset += n
    return tables


class _Batch(NamedTuple):
    ids: np.ndarray  # [Bp, Sp] int32, right-padded with 0
    lengths: np.ndarray  # [Bp] int32
    batch: int  # B, the caller's rows


def _pad_batch(ids: np.ndarray, lengths: np.ndarray) -> _Batch:
    b, s = ids.shape
    bp, sp = _pow2(b), max(MIN_PROMPT_BUCKET, _pow2(s))
    out = np.zeros((bp, sp), np.int32)
    out[:b, :s] = ids
    lens = np.ones((bp,), np.int32)  # dummy rows: one pad token
    lens[:b] = lengths
    return _Batch(out, lens, b)


# ---- input checks -------------------------------------------------------------------------------


def _prompts(input_ids, lengths, vocab_size: int, fn: str) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` as a ``[B, S]`` int32 array and ``lengths [B]``, checked. ``input_ids``: a
    ``[B, S]`` integer array (all tokens real unless ``lengths``), or a list of 1-D sequences of
    any lengths (right-padded here)."""
    if isinstance(input_ids, (list, tuple)) and input_ids and all(
            isinstance(r, (list, tuple, np.ndarray, jax.Array)) for r in input_ids):
        rows = [np.asarray(r) for r in input_ids]
        if any(r.ndim != 1 for r in rows):
            raise ValueError(f"{fn}: input_ids as a list must hold 1-D sequences, got shapes "
                             f"{[r.shape for r in rows]}")
        if len({len(r) for r in rows}) > 1:
            if lengths is not None:
                raise ValueError(f"{fn}: lengths is given, but input_ids is a ragged list "
                                 "(its lengths are the rows' lengths)")
            lengths = [len(r) for r in rows]
            width = max(lengths)
            rows = [np.pad(r, (0, width - len(r))) for r in rows]
        input_ids = np.stack(rows) if rows else np.zeros((0, 0), np.int32)
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"{fn}: input_ids must be [B, S] token ids, got shape {ids.shape}")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{fn}: input_ids must be integer token ids, got dtype {ids.dtype}")
    b, s = ids.shape
    if b == 0 or s == 0:
        raise ValueError(f"{fn}: input_ids must hold at least one token a row, got shape "
                         f"{ids.shape}")
    if lengths is None:
        lens = np.full((b,), s, np.int32)
    else:
        lens = np.asarray(lengths)
        if lens.shape != (b,) or lens.dtype == np.bool_ or not np.issubdtype(lens.dtype,
                                                                              np.integer):
            raise ValueError(f"{fn}: lengths must be [B={b}] integers, got shape {lens.shape} "
                             f"dtype {lens.dtype}")
        if ((lens < 1) | (lens > s)).any():
            raise ValueError(f"{fn}: lengths must be in [1, S={s}], got {lens.tolist()}")
    real = np.arange(s)[None, :] < lens[:, None]
    bad = real & ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        raise ValueError(f"{fn}: input_ids: {int(bad.sum())} token id(s) outside "
                         f"[0, vocab_size={vocab_size}); first bad id {int(ids[bad][0])}")
    return np.where(real, ids, 0).astype(np.int32), lens.astype(np.int32)


def _check_new_tokens(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"generate: max_new_tokens must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {n}")
    return int(n)


# ---- the model ----------------------------------------------------------------------------------


class GenerationTimes(NamedTuple):
    prefill_s: float  # prefill + first token, wall clock (includes compilation on a first call)
    decode_s_per_token: float  # mean over the decode steps (0.0 when max_new_tokens == 1)
    decode_steps: int


@dataclasses.dataclass
class Qwen3MoE:
    """A loaded Qwen3-MoE: ``forward`` (one prefill, all logits) and greedy ``generate``."""

    params: Qwen3MoEParams
    kv_dtype: KVDtype = KVDtype.BF16
    kernels: KernelConfig | None = None
    name: str = MODEL_TYPE
    # Fixed KV capacity a sequence (prompt + new tokens): block tables of ceil(max_seq_len / 16)
    # pages, so the decode step compiles once per batch bucket whatever the lengths; longer
    # generations raise. None: capacity buckets (powers of two >= 4 pages).
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        self.kv_dtype = KVDtype(self.kv_dtype)
        m = self.max_seq_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_seq_len: expected a positive int or None, got {m!r}")

    @property
    def config(self) -> Qwen3MoEConfig:
        return self.params.config

    def forward(self, input_ids, *, lengths=None) -> jax.Array:
        """Logits ``[B, S, V]`` float32 of ``input_ids [B, S]`` (one prefill into a fresh
        cache). With ``lengths`` (right padding), positions past ``lengths[b]`` are padding and
        their logits meaningless."""
        ids, lens = _prompts(input_ids, lengths, self.config.vocab_size, "forward")
        b, s = ids.shape
        batch = _pad_batch(ids, lens)
        pt = _pow2(math.ceil(batch.ids.shape[1] / PAGE_SIZE))
        needed = np.full((len(batch.lengths),), pt, np.int32)
        out = _prefill(self.params, batch.ids, batch.lengths, _tables(needed, pt),
                       num_pages=int(needed.sum()), kv_dtype=self.kv_dtype,
                       kernels=self.kernels, all_logits=True)
        return out[:b, :s]

    def generate(self, input_ids, max_new_tokens: int, *, lengths=None) -> jax.Array:
        """Greedy: ``[B, max_new_tokens]`` int32 new tokens for prompts ``input_ids``: a
        ``[B, S]`` array (``lengths [B]``: real tokens a row, right-padded) or a list of
        sequences of different lengths."""
        return self.generate_timed(input_ids, max_new_tokens, lengths=lengths, timed=False)[0]

    def generate_timed(self, input_ids, max_new_tokens: int, *, lengths=None,
                       timed: bool = True) -> tuple[jax.Array, GenerationTimes | None]:
        """``generate`` and its wall-clock times (``timed``: waits for the prefill before
        starting the decode steps, and for the last token)."""
        n = _check_new_tokens(max_new_tokens)
        ids, lens = _prompts(input_ids, lengths, self.config.vocab_size, "generate")
        batch = _pad_batch(ids, lens)
        # Cache positions a row needs: its prompt plus the n - 1 tokens fed back.
        needed = -(-(batch.lengths + n - 1) // PAGE_SIZE)  # [Bp] pages
        pt = max(MIN_CACHE_PAGES, _pow2(int(needed.max())))
        if self.max_seq_len is not None:
            longest = int(lens.max()) + n
            if longest > self.max_seq_len:
                raise ValueError(f"generate: the longest prompt ({int(lens.max())} tokens) plus "
                                 f"max_new_tokens={n} is {longest} tokens, over "
                                 f"max_seq_len={self.max_seq_len}")
            pt = -(-self.max_seq_len // PAGE_SIZE)
        tables = jnp.asarray(_tables(needed, pt))
        num_pages = len(needed) * pt  # the pool: fixed per (Bp, Pt) bucket
        t0 = time.perf_counter()
        tok, caches = _prefill(self.params, batch.ids, batch.lengths, tables,
                               num_pages=num_pages, kv_dtype=self.kv_dtype,
                               kernels=self.kernels, all_logits=False)
        if timed:
            tok.block_until_ready()
        t1 = time.perf_counter()
        positions = jnp.asarray(batch.lengths)
        out = [tok]
        for _ in range(n - 1):
            tok, caches, positions = _decode(self.params, caches, tok, positions, tables,
                                             kernels=self.kernels)
            out.append(tok)
        tokens = jnp.stack(out, axis=1)[:batch.batch]  # [B, n]
        if not timed:
            return tokens, None
        tokens.block_until_ready()
        t2 = time.perf_counter()
        return tokens, GenerationTimes(t1 - t0, (t2 - t1) / max(n - 1, 1), n - 1)

    def __repr__(self) -> str:
        c = self.config
        moe = sum(c.moe_layers)
        return (f"Qwen3MoE({self.name!r}: {c.num_layers} layers ({moe} MoE, "
                f"{c.num_layers - moe} dense), hidden {c.hidden_size}, vocab {c.vocab_size}, "
                f"kv {self.kv_dtype.value})")


# ---- loading ------------------------------------------------------------------------------------


def _cast(tree, dtype):
    """Floating arrays and BF16-format weights to ``dtype``; quantized weights as stored."""
    def one(x):
        if isinstance(x, QTensor):
            if x.format is Format.BF16:
                return dataclasses.replace(x, data=x.data.astype(dtype))
            return x
        if x is not None and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, QTensor))


def _dense_mlp(ck: Checkpoint, prefix: str) -> DenseMLPParams:
    block = MoEConfig.from_hf_config(ck.config).fp8_block
    lin = lambda name: linear_from_tensors(ck.get, ck.has, f"{prefix}{name}", block)  # noqa: E731
    return DenseMLPParams(gate_up=concat_rows(lin("gate_proj"), lin("up_proj")),
                          down=lin("down_proj"))


def load_params(ck: Checkpoint, *, dtype=jnp.bfloat16,
                act_quant: ActQuant = ActQuant.NONE) -> Qwen3MoEParams:
    """Every tensor of a qwen3_moe checkpoint, in the formats it stores them; floating arrays
    and BF16-format weights cast to ``dtype``. ``act_quant`` goes into every MoE layer's
    config as it is read (``with_act_quant``), so a checkpoint that cannot take it fails at
    its first MoE layer."""
    cfg = Qwen3MoEConfig.from_hf_config(ck.config)
    act_quant = ActQuant(act_quant)
    layers = []
    for i in range(cfg.num_layers):
        p = ck.layer(i)
        mlp = load_moe_layer(ck, i) if cfg.moe_layers[i] else _dense_mlp(ck, f"{p}mlp.")
        mlp = _mlp_with_act_quant(mlp, act_quant)
        layers.append(LayerParams(
            input_norm=jnp.asarray(ck.get(f"{p}input_layernorm.weight")),
            attention=load_attention_layer(ck, i),
            post_attention_norm=jnp.asarray(ck.get(f"{p}post_attention_layernorm.weight")),
            mlp=mlp,
        ))
    root = ck.layer_prefix.removesuffix("layers.")
    embed = jnp.asarray(ck.get(f"{root}embed_tokens.weight"))
    want = (cfg.vocab_size, cfg.hidden_size)
    if embed.shape != want:
        raise ValueError(f"{root}embed_tokens.weight: expected shape {want} (vocab_size, "
                         f"hidden_size), got {embed.shape}")
    head = None
    if not cfg.tie_word_embeddings:
        head = linear_from_tensors(ck.get, ck.has, "lm_head")
        if tuple(head.shape) != want:
            raise ValueError(f"lm_head.weight: expected shape {want}, got {head.shape}")
    params = Qwen3MoEParams(embed=embed, layers=tuple(layers),
                            norm=jnp.asarray(ck.get(f"{root}norm.weight")), lm_head=head,
                            config=cfg)
    return _cast(params, jnp.dtype(dtype))


def with_act_quant(params: Qwen3MoEParams, act_quant: ActQuant | str) -> Qwen3MoEParams:
    """``params`` with every MoE layer's ``gate_up_act_quant`` and ``down_act_quant`` set to
    ``act_quant`` (MoEConfig validates it against the layer's expert format: a ValueError
    naming the field for anything but FP8_BLOCK experts under W8A8)."""
    act_quant = ActQuant(act_quant)
    return dataclasses.replace(params, layers=tuple(
        dataclasses.replace(layer, mlp=_mlp_with_act_quant(layer.mlp, act_quant))
        for layer in params.layers))


def _mlp_with_act_quant(mlp, act_quant: ActQuant):
    if not isinstance(mlp, MoEParams):
        return mlp  # a dense layer: bf16 activations whatever the MoE layers do
    return dataclasses.replace(mlp, config=mlp.config.replace(gate_up_act_quant=act_quant,
                                                              down_act_quant=act_quant))


def load(ck: Checkpoint, *, kv_dtype=KVDtype.BF16, kernels: KernelConfig | None = None,
         dtype=jnp.bfloat16, max_seq_len: int | None = None,
         act_quant: ActQuant = ActQuant.NONE) -> Qwen3MoE:
    return Qwen3MoE(load_params(ck, dtype=dtype, act_quant=act_quant), kv_dtype=KVDtype(kv_dtype),
                    kernels=kernels, name=ck.path.name, max_seq_len=max_seq_len)
