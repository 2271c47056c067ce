"""Token tables padded to the model's vocabulary (training/data.py)."""

import pytest
import torch

from megatron_triroute.routing.side_features import TokenTables
from megatron_triroute.training.data import pad_tables, padded_vocab


def test_padding_ids_get_the_rarest_log_probability_and_start_no_word():
    tables = TokenTables(torch.tensor([-1.0, -7.5, -2.0]), torch.tensor([True, False, True]), eod_id=2)
    padded = pad_tables(tables, 5)
    assert padded.log_prob.tolist() == [-1.0, -7.5, -2.0, -7.5, -7.5]
    assert padded.word_start.tolist() == [True, False, True, False, False]
    assert padded.eod_id == 2
    assert pad_tables(tables, 3) is tables
    with pytest.raises(ValueError, match="smaller than the token tables' 3 ids"):
        pad_tables(tables, 2)


def test_the_vocabulary_pads_to_a_multiple_of_128_per_tensor_rank():
    assert [padded_vocab(1000, 1), padded_vocab(1024, 1), padded_vocab(1000, 2), padded_vocab(1025, 4)] == \
        [1024, 1024, 1024, 1536]
