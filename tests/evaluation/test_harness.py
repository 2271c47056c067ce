"""The lm-evaluation-harness model `triroute`, called the way the harness calls it (`Instance`
lists), on a real six-step run's checkpoint and tokenizer. Each result is checked against a
second computation: one direct engine forward of the whole token sequence, its log-softmax
summed by hand over the continuation."""

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402

from megatron_triroute.evaluation.harness import TriRouteLM  # noqa: E402
from megatron_triroute.inference.side_state import SideState  # noqa: E402


@pytest.fixture(scope="module")
def lm(trained_run):
    return TriRouteLM(checkpoint=str(trained_run / "checkpoints"), batch_size=1)


def direct_logprobs(lm, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i + 1] | tokens[: i + 1]) from one forward of the engine model (no harness code)."""
    model = lm.model
    cache = model.new_cache()
    cache.add_request(0)
    logits, _ = model.step(torch.tensor([tokens]), torch.tensor([len(tokens)]), [SideState()], cache, [0],
                           all_logits=True)
    logp = torch.log_softmax(logits[0].double(), -1)
    return logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]


def ll(lm, pairs):
    return lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)], disable_tqdm=True)


PAIRS = [("The history of", " the city"), ("def main():", "\n    return 0"), ("", "Hello world"),
         ("A long sentence about the river and the mountain, and then", " more words follow here")]


def test_loglikelihood_is_the_direct_sum_of_token_logprobs(lm):
    for (context, continuation), (value, greedy) in zip(PAIRS, ll(lm, PAIRS)):
        if context:
            ctx = lm.tok_encode(context)
            whole = lm.tok_encode(context + continuation)
        else:  # an empty context is conditioned on the end-of-document token
            ctx, whole = [lm.eot_token_id], [lm.eot_token_id] + lm.tok_encode(continuation)
        n = len(whole) - len(ctx)
        assert n > 0
        expected = direct_logprobs(lm, whole)[-n:]
        assert value == pytest.approx(float(expected.sum()), abs=1e-4)
        assert value < 0 and isinstance(greedy, bool)


def test_is_greedy(lm):
    context = lm.tok_encode("The history of the")
    greedy = []
    for _ in range(3):  # the model's own argmax continuation, token by token
        greedy.append(int(torch.argmax(_next_logits(lm, context + greedy))))
    other = (greedy[-1] + 1) % lm.model.config.model.vocab_size
    (value, is_greedy), (value2, is_greedy2) = lm._loglikelihood_tokens(
        [(None, context, greedy), (None, context, greedy[:-1] + [other])])
    assert is_greedy is True and is_greedy2 is False
    assert value == pytest.approx(float(direct_logprobs(lm, context + greedy)[-3:].sum()), abs=1e-4)


def _next_logits(lm, tokens):
    cache = lm.model.new_cache()
    cache.add_request(0)
    logits, _ = lm.model.step(torch.tensor([tokens]), torch.tensor([len(tokens)]), [SideState()], cache, [0])
    return logits[0]


def test_rolling_equals_full_document_nll_when_it_fits(lm):
    text = "The river runs through the old town. It was built in the year of the great flood."
    tokens = lm.tok_encode(text)
    assert len(tokens) < lm.max_length
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    expected = direct_logprobs(lm, [lm.eot_token_id] + tokens).sum()
    assert rolling == pytest.approx(float(expected), abs=1e-4)


def test_rolling_windows_cover_a_long_document_once(lm):
    text = " ".join(f"word{i} is here" for i in range(60))
    tokens = lm.tok_encode(text)
    assert len(tokens) > 2 * lm.max_length
    before = lm.audits["loglikelihood_rolling"].tokens
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    # Disjoint windows of max_length predictions: every token is predicted exactly once, each
    # window run as max_length inputs (the first from the end-of-document token).
    windows = -(-len(tokens) // lm.max_length)
    assert lm.audits["loglikelihood_rolling"].tokens - before <= windows * lm.max_length
    manual = 0.0
    for w in range(windows):
        lo, hi = w * lm.max_length, min((w + 1) * lm.max_length, len(tokens))
        inputs = ([lm.eot_token_id] + tokens)[max(0, hi - lm.max_length) : hi + 1]
        manual += float(direct_logprobs(lm, inputs)[-(hi - lo):].sum())
    assert rolling == pytest.approx(manual, abs=1e-3)


def test_generate_until_stops_at_until(lm):
    context = "The history of the"
    request = lambda until, i=0: Instance("generate_until", {}, (context, {"until": until, "max_gen_toks": 16}), i)
    (free,) = lm.generate_until([request([])])
    stops = [free[k : k + 2] for k in range(1, len(free) - 1) if free[k : k + 2].strip() and free.find(free[k : k + 2]) == k]
    assert stops, f"the greedy text {free!r} has no usable stop string"
    stop = stops[0]
    before = lm.audits["generate_until"].tokens
    (cut,) = lm.generate_until([request([stop])])
    assert cut == free[: free.index(stop)]
    with_stop = lm.audits["generate_until"].tokens - before
    before = lm.audits["generate_until"].tokens
    lm.generate_until([request([])])
    assert with_stop < lm.audits["generate_until"].tokens - before  # it stopped early, not just cut the text


def test_batch_size_does_not_change_results(lm):
    gen = [Instance("generate_until", {}, (c or "Once", {"until": ["\n"], "max_gen_toks": 6}), i)
           for i, (c, _) in enumerate(PAIRS)]
    lm.batch_size = 1
    one, gen_one = ll(lm, PAIRS), lm.generate_until(gen)
    lm.batch_size = 3
    try:
        three, gen_three = ll(lm, PAIRS), lm.generate_until(gen)
    finally:
        lm.batch_size = 1
    assert [g for _, g in one] == [g for _, g in three]
    assert [v for v, _ in one] == pytest.approx([v for v, _ in three], abs=1e-5)
    assert gen_one == gen_three


def test_empty_continuation_guard(lm):
    # A context + continuation that encodes as one piece: the harness's own split leaves nothing.
    pieces = [lm.processor.id_to_piece(i) for i in range(lm.processor.get_piece_size())]
    words = [p[1:] for p in pieces if p.startswith("\u2581") and len(p) >= 5 and p[1:].isalpha()]
    for word in words:
        context, continuation = word[:-1], word[-1]
        if not TemplateLM._encode_pair(lm, context, continuation)[1]:
            break
    else:
        pytest.fail("no merging context/continuation pair in this vocabulary")
    context_enc, continuation_enc = lm._encode_pair(context, continuation)
    assert continuation_enc and context_enc + continuation_enc == lm.tok_encode(context + continuation)
    (value, _), (empty, empty_greedy) = ll(lm, [(context, continuation), ("The history", "")])
    whole = (context_enc or [lm.eot_token_id]) + continuation_enc
    expected = direct_logprobs(lm, whole)[-len(continuation_enc):].sum()
    assert value == pytest.approx(float(expected), abs=1e-4) and value < 0
    assert (empty, empty_greedy) == (0.0, True)


def test_cost_is_reported_with_the_model_info(lm):
    ll(lm, PAIRS[:1])
    info = lm.get_model_info()
    cost = info["triroute_cost"]
    assert info["triroute_step"] == 6 and cost["loglikelihood"]["tokens"] > 0
    for entry in cost.values():
        assert 0 < entry["realised_flops"] < 1.5 and 0 < entry["realised_mem"] < 1
    assert cost["all"]["tokens"] == sum(v["tokens"] for k, v in cost.items() if k != "all")
