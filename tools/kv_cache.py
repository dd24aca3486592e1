"""Speedup (exact) of generation on CPUs: a KV cache whose layers are written in place.

`agent._generate` and `agent.CachedGenerate` get their caches from `room_for`; made a no-op
(`room_for = lambda cache, model, tokens: cache`), transformers' own `DynamicCache` is used, and
tests/test_agent.py proves the two give the same tokens and log-probs. This file imports no
project file.
"""
from transformers.cache_utils import DynamicLayer


def room_for(cache, model, tokens: int):
    """Speedup of transformers' `DynamicCache`, which `generate` makes when given none and whose
    layers append each step's keys and values by concatenation (`DynamicLayer.update`):

        self.keys = torch.cat([self.keys, key_states], dim=-2)    # every step copies the whole cache

    That copy is a large share of a decode step on CPUs (docs/performance.md). Here each layer keeps
    its keys and values in room made in advance for `tokens` positions in all (`GrowingLayer`), and
    each step writes its new position in place; attention reads the filled part as a view, so it sees
    the same numbers. `cache`: None (a new one), or one made here (given room for `tokens`: at most
    one copy). A model with sliding-window layers keeps transformers' own layers."""
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=model.config)
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            return cache  # sliding windows and other layer types: transformers' as they are
        cache.layers = [GrowingLayer() for _ in cache.layers]
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.make_room(tokens)
    return cache


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of the first `length` positions of a larger
    buffer. Assigning `keys`/`values` (batch selection, compaction, repetition, crop) adopts the new
    tensor as the buffer; `make_room(n)` grows it, with one copy, to hold n positions; an update past
    the room doubles it."""

    def __init__(self, **kwargs):
        self._keys = self._values = None
        self.length, self.room = 0, 0
        super().__init__(**kwargs)

    keys = property(lambda self: None if self._keys is None else self._keys[:, :, :self.length],
                    lambda self, t: self._adopt("_keys", t))
    values = property(lambda self: None if self._values is None else self._values[:, :, :self.length],
                      lambda self, t: self._adopt("_values", t))

    def _adopt(self, name, tensor):
        setattr(self, name, tensor)
        if tensor is not None and tensor.dim() == 4:
            self.length = tensor.shape[2]

    def make_room(self, n: int):
        self.room = max(self.room, n)
        if self._keys is not None and self._keys.shape[2] < n:
            for name in ("_keys", "_values"):
                old = getattr(self, name)
                buffer = old.new_empty(*old.shape[:2], n, old.shape[3])
                buffer[:, :, :self.length] = old[:, :, :self.length]
                setattr(self, name, buffer)

    def update(self, key_states, value_states, *args, **kwargs):
        if self._keys is None:  # the first update (prefill): room for everything this call will cache
            self.lazy_initialization(key_states, value_states)
            b, h, _, d = key_states.shape
            self._keys, self._values = (key_states.new_empty(b, h, self.room, d) for _ in range(2))
            self.length = 0
        n = key_states.shape[2]
        if self.length + n > self._keys.shape[2]:  # past the room made in advance: double it
            self.make_room(max(self.length + n, 2 * self._keys.shape[2]))
        self._keys[:, :, self.length:self.length + n] = key_states
        self._values[:, :, self.length:self.length + n] = value_states
        self.length += n
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self._keys is not None else 0
