"""tools/kv_cache.py by hand. That generation with it equals generation with transformers' own
cache is tested where generation lives (tests/test_agent.py::test_the_cache_written_in_place_equals_transformers_own)."""
import torch

from tools.kv_cache import GrowingLayer


def test_growing_layer_by_hand():
    """tools/kv_cache.GrowingLayer: room made in advance, each update written into it (no new buffer), a view
    of the filled part returned; past the room the buffer doubles keeping what it held; transformers'
    own edits (batch selection) adopt their result as the buffer."""
    layer = GrowingLayer()
    layer.make_room(5)
    k = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    keys, values = layer.update(k, -k)
    assert layer._keys.shape == (2, 1, 5, 2) and layer.get_seq_length() == 3 and torch.equal(keys, k)
    buffer, new = layer._keys, torch.full((2, 1, 1, 2), 9.0)
    keys, _ = layer.update(new, -new)
    assert layer._keys is buffer and keys.data_ptr() == buffer.data_ptr() and keys.shape == (2, 1, 4, 2)
    assert torch.equal(keys[:, :, 3], new[:, :, 0]) and torch.equal(keys[:, :, :3], k)
    layer.update(new, -new)
    layer.update(new, -new)  # the sixth position: past the room of 5
    assert layer._keys.shape[2] == 10 and layer.get_seq_length() == 6 and torch.equal(layer.keys[:, :, :3], k)
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape == (1, 1, 6, 2) and layer.get_seq_length() == 6 and torch.equal(layer.values, -layer.keys)
    assert torch.equal(layer.keys[0, 0, :3], k[1, 0])
