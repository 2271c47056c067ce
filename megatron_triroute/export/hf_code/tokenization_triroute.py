"""The sentencepiece ("slow") tokenizer of an exported TriRoute model: `tokenizer.model` itself.

Text is encoded exactly as training data was (`SentencePieceProcessor.encode`, no BOS/EOS added;
the end-of-document token `</s>` is appended by whoever builds a document). The fast tokenizer
(`tokenizer.json`, what `AutoTokenizer` loads) tokenizes identically.
"""

from transformers.tokenization_utils_sentencepiece import SentencePieceBackend


class TriRouteTokenizer(SentencePieceBackend):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file=None, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>",
                 **kwargs):
        kwargs.setdefault("split_special_tokens", True)  # "</s>" in text is text, as sentencepiece reads it
        kwargs.setdefault("add_bos_token", False)
        kwargs.setdefault("add_eos_token", False)
        super().__init__(vocab_file=vocab_file, unk_token=unk_token, bos_token=bos_token, eos_token=eos_token,
                         pad_token=pad_token, legacy=True, **kwargs)

    @property
    def vocab_size(self):
        return self.sp_model.get_piece_size()

    def get_vocab(self):
        vocab = {self.sp_model.id_to_piece(i): i for i in range(self.vocab_size)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text, **kwargs):
        return self.sp_model.encode(text, out_type=str)

    def tokenize(self, text, **kwargs):
        return self.sp_model.encode(text, out_type=str)

    def _convert_token_to_id(self, token):
        return self.sp_model.piece_to_id(token)

    def _convert_id_to_token(self, index):
        return self.sp_model.id_to_piece(index)

    def convert_tokens_to_string(self, tokens):
        return self.sp_model.decode_pieces(tokens)

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return token_ids_0 + (token_ids_1 or [])
