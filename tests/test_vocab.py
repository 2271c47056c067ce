"""Generated ids to text (vocab.decode_generated), as generate and the lm-eval model decode them."""

from megatron_triroute.vocab import decode_generated


class Pieces:
    """A four-piece tokenizer: id i decodes to "abcd"[i]."""

    def get_piece_size(self) -> int:
        return 4

    def decode(self, ids: list[int]) -> str:
        return "".join("abcd"[i] for i in ids)


def test_eod_and_the_padded_vocabulary_ids_have_no_text():
    # ids 4..127 exist only in the model's padded vocabulary; 3 is EOD
    assert decode_generated(Pieces(), [0, 3, 1, 4, 127, 2], eod=3) == "abc"
    assert decode_generated(Pieces(), [], eod=3) == ""
