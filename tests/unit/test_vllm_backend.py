"""How a cache's rows become vLLM requests and vLLM's captured layers become the cache's (train/vllm_backend.py)."""

import pytest
import torch

from draftheads.data.hidden_states import CacheError
from draftheads.train.vllm_backend import aux_ids, documents


def test_a_packed_row_is_one_request_per_document_with_the_padding_on_the_last():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0],    # three documents (3 + 2 + 1 tokens), two of padding
                              [0, 1, 2, 3, 4, 5, 6, 7]])   # one document, no padding
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    assert documents(positions, mask) == [[(0, 3), (3, 5), (5, 8)], [(0, 8)]]


def test_a_document_that_does_not_start_at_position_zero_is_refused():
    with pytest.raises(CacheError, match="row 0: a document starts at position 3"):
        documents(torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.long))


def test_vllm_is_asked_for_the_layers_sorted_once_plus_the_last_layer_output():
    assert aux_ids([3, 1, 2], 4) == [1, 2, 3, 4]
    assert aux_ids([], 32) == [32]  # Medusa / EAGLE-1: the final state only
    assert aux_ids([2, 2, 16, 29], 32) == [2, 16, 29, 32]
