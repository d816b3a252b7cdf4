"""kvret.hf: kvret inside Hugging Face transformers' generate().

    import kvret.hf
    cache = kvret.hf.KvretCache(model, index_kind="pq", budget_ratio=0.1)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)

KvretCache is a transformers Cache. The prompt (prefill) attends densely with the model's own attention, and its keys
and values go to kvret; every decode step of every full-attention layer then appends the new token to kvret and
attends through kvret_seq_attend (select, fetch and attention over the working set: sink, selected and local tokens),
so the full-attention layers keep no dense copy in torch. Sliding-window layers (Gemma 3) keep their window in
transformers' own DynamicSlidingWindowLayer. Each batch row is one kvret sequence; left padding never enters it.

The routing uses transformers' public interfaces only: the cache registers an attention function ("kvret_<impl>",
e.g. "kvret_sdpa") with AttentionInterface and its mask function with AttentionMaskInterface, and sets it on the
model (model.set_attn_implementation). It hands every call on to the model's own implementation (<impl>) unless the
call is a decode step of a KvretCache layer, so the model keeps working with its default cache afterwards.

This module needs torch and transformers (`import kvret` does not).
"""

import sys
import threading
import time

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(f"kvret.hf needs torch and transformers (pip install torch transformers): {error}") from None

from .context import Context
from .errors import KvretError, Status

__all__ = ["KvretCache"]

_KV_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_HEAD_DIMS = (64, 128, 256)

# The layer whose cache update is waiting for its attention call (set by update(), taken by the attention function,
# both on the thread running the forward pass).
_pending = threading.local()


def _unsupported(message):
    return KvretError(Status.UNSUPPORTED, f"kvret.hf: {message}")


# ---- the attention function ----------------------------------------------------------------------------------------


def _fallback(module, base):
    """The model's own attention function for the implementation `base`."""
    function = ALL_ATTENTION_FUNCTIONS.get(base) if base != "eager" else None
    if function is None:  # eager lives in each model's modeling file
        function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise _unsupported(f"no attention function '{base}' for {type(module).__name__}")
    return function


def _attention_function(base):
    def kvret_attention(module, query, key, value, attention_mask, **kwargs):
        step = getattr(_pending, "step", None)
        if step is not None and step[1] == getattr(module, "layer_idx", None):
            _pending.step = None
            layer = step[0]
            if step[2] == "decode":
                return layer.attend(module, query, kwargs.get("scaling")), None
            layer.append_prompt(key, value, attention_mask, step[3])
        return _fallback(module, base)(module, query, key, value, attention_mask, **kwargs)

    return kvret_attention


def _route(model):
    """Sets the model's attention implementation to kvret's wrapper of the one it has (registered once)."""
    current = model.config._attn_implementation
    base = current[len("kvret_") :] if current.startswith("kvret_") else current
    name = f"kvret_{base}"
    if name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        AttentionInterface.register(name, _attention_function(base))
        if base in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[base])
    if current != name:
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise _unsupported(f"{type(model).__name__} does not take an attention function (AttentionInterface)")


# ---- one full-attention layer ------------------------------------------------------------------------------------


class KvretLayer(CacheLayerMixin):
    """A full-attention layer whose keys and values live in kvret (layer `kvret_layer` of the cache's sequences)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache, layer_idx, kvret_layer):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.kvret_layer = kvret_layer
        self.length = 0  # tokens as transformers counts them (padding included)

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if getattr(_pending, "step", None) is not None:
            raise KvretError(
                Status.STATE,
                "kvret.hf: a layer's attention did not go through kvret (the model's attention implementation was "
                "changed after the KvretCache was made)",
            )
        cache = self.cache
        batch, _, tokens, _ = key_states.shape
        cache.open_rows(batch)
        past = self.length
        if tokens == 1 and past > 0:
            for row, seq in enumerate(cache.sequences):
                started = time.perf_counter()
                seq.append_decode(self.kvret_layer, key_states[row, :, 0, :], value_states[row, :, 0, :])
                cache.kvret_seconds += time.perf_counter() - started
            _pending.step = (self, self.layer_idx, "decode", None)  # once the appends succeeded
            self.length += 1
            return key_states, value_states
        # A prompt (or a later turn's new tokens): dense attention over everything before it, read back from kvret.
        if past > 0:
            if batch != 1:
                raise _unsupported("a batch of more than one row cannot add several tokens to a filled cache")
            stored_k, stored_v = cache.sequences[0].read(self.kvret_layer, 0, past)
            to = dict(dtype=key_states.dtype, device=key_states.device)
            key_states = torch.cat([torch.from_numpy(stored_k).permute(1, 0, 2)[None].to(**to), key_states], dim=2)
            value_states = torch.cat(
                [torch.from_numpy(stored_v).permute(1, 0, 2)[None].to(**to), value_states], dim=2
            )
        _pending.step = (self, self.layer_idx, "prompt", tokens)
        self.length += tokens
        return key_states, value_states

    def append_prompt(self, key_states, value_states, attention_mask, tokens):
        """Appends the prompt's last `tokens` keys and values of every row, without its padding (the keys the
        mask's last query row does not attend to)."""
        cache = self.cache
        started = time.perf_counter()
        new_k, new_v = key_states[:, :, -tokens:, :], value_states[:, :, -tokens:, :]
        for row, seq in enumerate(cache.sequences):
            keep = _attended(attention_mask, row, tokens)
            k, v = new_k[row], new_v[row]
            if keep is not None:
                k, v = k[:, keep, :], v[:, keep, :]
            if k.shape[1] == 0:
                continue
            # a later turn's tokens too: kvret_append_prefill takes chunks (the index encodes or retrains)
            seq.append_prefill(self.kvret_layer, k.transpose(0, 1), v.transpose(0, 1))
        cache.kvret_seconds += time.perf_counter() - started

    def attend(self, module, query, scaling):
        """Attention of every row's query (query [batch, n_q_heads, 1, head_dim]) through kvret_seq_attend;
        [batch, 1, n_q_heads, head_dim] in the query's dtype."""
        cache = self.cache
        started = time.perf_counter()
        # the CPU backend writes the model's dtype itself; the CUDA backend's attention writes float32
        dtype = query.dtype if query.device.type == "cpu" else torch.float32
        out = torch.empty(query.shape[0], query.shape[1], query.shape[3], dtype=dtype, device=query.device)
        for row, seq in enumerate(cache.sequences):
            seq.attend(self.kvret_layer, query[row, :, 0, :], scale=scaling, out=out[row])
        cache.kvret_seconds += time.perf_counter() - started
        cache.decode_calls += 1
        return out.to(query.dtype)[:, None]

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1

    def reset(self):
        self.length = 0

    def reorder_cache(self, beam_idx):
        pass  # the cache reorders its sequences once for all layers

    def crop(self, tokens_to_remove):
        raise _unsupported("cropping a KvretCache (assisted decoding) is not supported")


def _attended(mask, row, tokens):
    """Which of the last `tokens` keys of `row` the last query attends to (None: all of them)."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return None
    last = mask[row if mask.shape[0] > 1 else 0, 0, -1, -tokens:]
    keep = last if last.dtype == torch.bool else last == 0
    return None if bool(keep.all()) else keep


# ---- the cache ---------------------------------------------------------------------------------------------------


class KvretCache(Cache):
    """A transformers Cache whose full-attention layers live in kvret: pass it to generate() as past_key_values.

    KvretCache(model, **config): config holds kvret config fields by name (index_kind, budget, budget_ratio, n_sink,
    n_local, pq_m, page_size, device_type, n_threads, ...; see kvret.Context); the geometry (layers, heads,
    head_dim), kv_dtype (the model's dtype) and check_finite=1 come from the model unless given. Extra keywords:
    context= an open kvret.Context to share (its session store, say) instead of a new one; session= the id of a
    conversation saved with save_session(), whose tokens the cache starts from (the next turn).

    Raises KvretError (Status.UNSUPPORTED) for a model kvret cannot serve, naming what is unsupported: MLA, a head_dim
    other than 64, 128 or 256, a dtype other than float32/float16/bfloat16, logit soft-capping, layer kinds other
    than full and sliding-window attention, encoder-decoders.
    """

    def __init__(self, model, context=None, session=None, **config):
        text = model.config.get_text_config(decoder=True)
        layer_types = _check_model(model, text)
        self.model_dtype = next(model.parameters()).dtype
        self.kvret_layers = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
        layers = []
        for i, kind in enumerate(layer_types):
            if kind == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=text.sliding_window))
            else:
                layers.append(KvretLayer(self, i, self.kvret_layers.index(i)))
        super().__init__(layers=layers)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        geometry = dict(
            n_layers=len(self.kvret_layers),
            n_q_heads=text.num_attention_heads,
            n_kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
        )
        self._owns_context = context is None
        if context is None:
            options = dict(geometry, kv_dtype=_KV_DTYPES[self.model_dtype], check_finite=1)
            options.update(config)
            context = Context(**options)
        else:
            if config:
                raise TypeError("kvret.hf: pass either context= or config fields, not both")
            have = {name: context.config[name] for name in geometry}
            if have != geometry:
                raise KvretError(Status.SHAPE, f"kvret.hf: the context's geometry {have} is not the model's {geometry}")
        self.context = context
        self.sequences = []
        self.kvret_seconds = 0.0  # time inside kvret calls (appends, attention)
        self.decode_calls = 0  # layer decode steps attended through kvret
        if session is not None:
            self._open_session(session)
        _route(model)

    # -- sequences --
    def open_rows(self, batch):
        """One kvret sequence per batch row, opened at the first update."""
        if not self.sequences:
            self.sequences = [self.context.open_sequence() for _ in range(batch)]
        elif len(self.sequences) != batch:
            raise KvretError(
                Status.SHAPE, f"kvret.hf: the cache holds {len(self.sequences)} rows, the input has {batch}"
            )

    def _open_session(self, session):
        if len(self.kvret_layers) != len(self.layers):
            raise _unsupported("a session of a model with sliding-window layers (their window is not saved)")
        seq = self.context.open_session(session)
        if seq is None:
            raise KvretError(Status.NOT_FOUND, f"kvret.hf: no saved session {session!r}")
        self.sequences = [seq]
        for layer in self.layers:
            layer.length = seq.length(layer.kvret_layer)
            layer.is_initialized = True

    def save_session(self, session_id):
        """Saves the conversation (batch of one) in the context's session store; KvretCache(model,
        context=cache.context, session=session_id) continues it, as if the whole conversation were prefilled again."""
        if len(self.kvret_layers) != len(self.layers):
            raise _unsupported("a session of a model with sliding-window layers (their window is not saved)")
        if len(self.sequences) != 1:
            raise _unsupported(f"save_session needs a batch of one row, the cache holds {len(self.sequences)}")
        self.sequences[0].save_session(session_id)

    def close(self):
        """Closes the sequences (and the context, when the cache made it)."""
        for seq in self.sequences:
            seq.close()
        self.sequences = []
        if self._owns_context:
            self.context.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self):
        """kvret's statistics summed over the rows, plus kvret_seconds and decode_calls."""
        total = {}
        for seq in self.sequences:
            for name, value in seq.stats().items():
                total[name] = total.get(name, 0) + value
        total.update(kvret_seconds=self.kvret_seconds, decode_calls=self.decode_calls)
        return total

    # -- batch operations of generate() --
    def _replace_rows(self, rows):
        old = self.sequences
        self.sequences = [old[i].fork() for i in rows]
        for seq in old:
            seq.close()

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        if self.sequences:
            self._replace_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats):
        super().batch_repeat_interleave(repeats)
        if self.sequences:
            self._replace_rows([i for i in range(len(self.sequences)) for _ in range(repeats)])

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        if self.sequences:
            self._replace_rows(torch.as_tensor(indices).reshape(-1).tolist())

    def crop(self, tokens_to_remove):
        raise _unsupported("cropping a KvretCache (assisted decoding) is not supported")

    def reset(self):
        super().reset()
        for seq in self.sequences:
            seq.close()
        self.sequences = []


def _check_model(model, text):
    """The layer types of a model kvret can serve; KvretError naming what it cannot."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise _unsupported(f"{name} is an encoder-decoder model")
    if any(getattr(text, field, None) for field in ("kv_lora_rank", "q_lora_rank")):
        raise _unsupported(f"{name} uses multi-head latent attention (MLA), whose compressed keys kvret does not store")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if head_dim not in _HEAD_DIMS:
        raise _unsupported(f"{name} has head_dim {head_dim}; kvret supports {', '.join(map(str, _HEAD_DIMS))}")
    dtype = next(model.parameters()).dtype
    if dtype not in _KV_DTYPES:
        raise _unsupported(f"{name} runs in {dtype}; kvret supports float32, float16 and bfloat16")
    if getattr(text, "attn_logit_softcapping", None):
        raise _unsupported(f"{name} soft-caps its attention logits, which kvret's attention does not")
    if getattr(text, "use_bidirectional_attention", False):
        raise _unsupported(f"{name} uses bidirectional attention")
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"] * (
            text.num_hidden_layers
        )
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise _unsupported(f"{name} has layers of kind {', '.join(other)}; kvret serves full and sliding-window ones")
    if "full_attention" not in layer_types:
        raise _unsupported(f"{name} has no full-attention layer")
    return list(layer_types)
