"""The harness's own `hf` model on the Hugging Face export of a trained run gives the numbers the
`triroute` model gives on the training checkpoint: the same log-likelihoods, the same greedy flags,
the same rolling log-likelihood (two implementations of the harness interface, one exported model)."""

import pytest

from tests.hf_home import isolate_hf_home

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

isolate_hf_home()  # keep remote code and caches out of the home directory, offline

from lm_eval.api.instance import Instance  # noqa: E402

from megatron_triroute.evaluation.harness import TriRouteLM  # noqa: E402

PAIRS = [("", "Hello world"), ("The history of", " the city"), ("def main():", "\n    return 0"),
         ("A long sentence about the river and the mountain, and then", " more words follow here")]
DOCS = ["Numbers 12345 and\ttabs,  double spaces\nand a new line.", "def f(x):\n    return x + 1\n"]


@pytest.fixture(scope="module")
def models(trained_run, tmp_path_factory):
    from lm_eval.models.huggingface import HFLM

    from megatron_triroute.export.exporter import export

    ours = TriRouteLM(checkpoint=str(trained_run / "checkpoints"), batch_size=1)
    hf_dir = export(trained_run / "checkpoints", tmp_path_factory.mktemp("hf_export") / "model")
    # The export's tokenizer keeps sentencepiece's <s> as its BOS; the model was trained on documents
    # separated by the end-of-document token, which both models must use as the prefix (README).
    hf = HFLM(pretrained=str(hf_dir), trust_remote_code=True, device="cpu", dtype="float32", batch_size=1,
              prefix_token_id=ours.prefix_token_id)
    assert hf.tokenizer.eos_token_id == ours.prefix_token_id
    return ours, hf


def test_hf_model_on_the_export_gives_the_triroute_models_loglikelihoods(models):
    ours, hf = models
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    got_ours = ours.loglikelihood(requests, disable_tqdm=True)
    got_hf = hf.loglikelihood(requests, disable_tqdm=True)
    for (lp_ours, greedy_ours), (lp_hf, greedy_hf) in zip(got_ours, got_hf):
        assert lp_hf == pytest.approx(lp_ours, abs=1e-4)
        assert greedy_hf == greedy_ours


def test_hf_model_on_the_export_gives_the_same_rolling_loglikelihood(models):
    ours, hf = models
    requests = [Instance("loglikelihood_rolling", {}, (doc,), i) for i, doc in enumerate(DOCS)]
    got_ours = ours.loglikelihood_rolling(requests, disable_tqdm=True)
    got_hf = hf.loglikelihood_rolling(requests, disable_tqdm=True)
    assert got_hf == pytest.approx(got_ours, abs=1e-4)
