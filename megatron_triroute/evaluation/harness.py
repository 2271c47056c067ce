"""lm-evaluation-harness model `triroute`: a `TemplateLM` on the hard-decision inference engine.

    import megatron_triroute.evaluation.harness   # registers "triroute" with lm_eval's registry
    lm_eval.simple_evaluate(model="triroute", model_args="checkpoint=RUN/checkpoints", tasks=[...])

or the harness's own command line with the model registered:

    python -m megatron_triroute.lm_eval_harness run --model triroute --model_args checkpoint=RUN/checkpoints \
        --tasks lambada_openai [--output_path OUT]

`model_args`: `checkpoint` (a run's checkpoint root or one step_* directory), `data` (the run's
data_prep output when its recorded data.path does not resolve), `max_length` (default: the
model's training sequence length), `max_gen_toks` (256), `page_size` (16), `calibrate` (false: true
calibrates the deployed prices first, as the run does at its end, on its training batches before
the checkpoint's step; a budgeted checkpoint written mid-run is otherwise served with prices 0, the
plain argmax policy, with a warning), `target_flops`, `target_mem` (default: the model's own budget:
serve at these fractions of the dense cost; scoring prices every sequence with the prices the
price curve gives them, `generate_until` meets them per request with the engine's per-request
control, inference/serve_budget.py; a target the routing cannot reach is refused naming the
reachable range). `batch_size` is the harness's own option.

Scoring runs every (context + continuation) through the engine with noise-free priced decisions,
only the selected computation (`scoring.score_batch`); the end-of-document token is the prefix of
an empty context and of the rolling windows. `generate_until` is greedy on `InferenceEngine`, stops
at the end-of-document token or when an `until` string appears, and returns the text before it.
The engine's `CostAudit` counts everything run; the realised (FLOPs, KV-memory) fractions are
logged after each request type and returned by `get_model_info()` (`triroute_cost`), which the
harness writes into the results' `config` next to the task metrics.
"""

from __future__ import annotations

import logging

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from ..inference.audit import COUNTERS, CostAudit
from ..vocab import decode_generated
from .calibration import score_at_targets, serve_curve, serve_prices
from .loading import EvaluationSetupError, load_for_evaluation
from .scoring import score_batch

log = logging.getLogger("lm_eval.models.triroute")


def _fraction(name: str, value) -> float:
    """A target model_arg (text from the command line, or a number)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise EvaluationSetupError(f"{name}={value!r}: must be a number (a fraction of the dense cost)") from None

LAST_COST: dict | None = None
"""The cost report of the most recently used `triroute` model (what the CLI wrapper prints)."""


def merge_audit(into: CostAudit, other: CostAudit) -> None:
    """Add `other`'s counters to `into` (same layer count)."""
    for layer, counts in zip(into.layers, other.layers):
        for name in COUNTERS:
            layer[name] += counts[name]
    into.lm_head += other.lm_head
    into.tokens += other.tokens
    into.dense_macs += other.dense_macs
    into.dense_kv_bytes += other.dense_kv_bytes


def cost_dict(audit: CostAudit) -> dict:
    return {"tokens": audit.tokens, "realised_flops": audit.realised_flops(), "realised_mem": audit.realised_mem()}


@register_model("triroute")
class TriRouteLM(TemplateLM):
    def __init__(self, checkpoint: str, data: str | None = None, batch_size: int | str | None = 1,
                 max_length: int | None = None, max_gen_toks: int = 256, page_size: int = 16, device: str | None = None,
                 max_batch_size: int | None = None, calibrate: bool | str = False,
                 target_flops: float | str | None = None, target_mem: float | str | None = None, **unused):
        super().__init__()
        if unused:
            raise EvaluationSetupError(f"unknown model_args {sorted(unused)} for model 'triroute'. Fix: use "
                                       "checkpoint=DIR and optionally data=DIR, max_length=N, max_gen_toks=N, "
                                       "page_size=N, calibrate=true, target_flops=F, target_mem=M.")
        if device not in (None, "cpu"):
            log.warning("the triroute engine runs on the CPU; device=%s ignored", device)
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            raise EvaluationSetupError("batch_size=auto is not supported by 'triroute'. Fix: pass --batch_size N.")
        self.batch_size = int(batch_size or 1)
        if self.batch_size < 1:
            raise EvaluationSetupError(f"batch_size={self.batch_size}: must be >= 1")
        if isinstance(calibrate, str):  # model_args values arrive as text
            if calibrate.lower() not in ("true", "false"):
                raise EvaluationSetupError(f"calibrate={calibrate!r}: must be true or false")
            calibrate = calibrate.lower() == "true"
        loaded = load_for_evaluation(checkpoint, data)
        serve_prices(loaded, bool(calibrate), "pass calibrate=true in model_args", log.warning, int(page_size))
        self.targets = tuple(None if t in (None, "") else _fraction(name, t)
                             for name, t in (("target_flops", target_flops), ("target_mem", target_mem)))
        self.curve = serve_curve(loaded, [self.targets], log.warning, int(page_size))
        score_at_targets(loaded, self.curve, self.targets)
        self.prices = loaded.prices
        self.checkpoint = str(loaded.step_path)
        self.step = loaded.step
        self.model = loaded.model
        self.processor = loaded.processor
        self._eod = loaded.eod
        self.max_length = int(max_length or self.model.config.model.seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self.page_size = int(page_size)
        n_layers = self.model.config.model.n_layers
        self.audits = {name: CostAudit(n_layers) for name in ("loglikelihood", "loglikelihood_rolling", "generate_until")}

    # -- tokenizer -----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eod

    @property
    def prefix_token_id(self) -> int:
        return self._eod

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.processor.encode(string))

    def tok_decode(self, tokens: list[int]) -> str:
        return decode_generated(self.processor, tokens, self._eod)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """The harness's split (encode context + continuation, cut after the context's token
        count), with a guard for the case where that leaves no continuation tokens: the
        continuation merged into the context's last pieces (e.g. context "th", continuation "e"
        encoding as one piece "the"). The cut then moves back to where the whole text's tokens
        stop matching the context's, so the continuation keeps the pieces that hold its
        characters; a continuation that adds no token at all (empty text) stays empty and scores 0."""
        context_enc, continuation_enc = super()._encode_pair(context, continuation)
        if continuation_enc:
            return context_enc, continuation_enc
        whole = self.tok_encode(context + continuation)
        common = 0
        while common < min(len(whole), len(context_enc)) and whole[common] == context_enc[common]:
            common += 1
        return whole[:common], whole[common:]

    # -- scoring -------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, audit: CostAudit | None = None,
                              **kwargs) -> list[tuple[float, bool]]:
        direct = audit is None  # not the rolling windows of loglikelihood_rolling
        audit = self.audits["loglikelihood"] if direct else audit
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        work = []
        for i, (key, context_enc, continuation_enc) in enumerate(requests):
            if not continuation_enc:  # nothing to score: log 1 = 0, trivially greedy
                results[i] = (0.0, True)
                continue
            if len(continuation_enc) > self.max_length:
                raise EvaluationSetupError(f"a continuation of {len(continuation_enc)} tokens does not fit "
                                           f"max_length={self.max_length}. Fix: pass model_args max_length=N (N >= "
                                           f"{len(continuation_enc)}) or shorten the task's continuations.")
            if not context_enc:
                context_enc = [self.prefix_token_id]
            whole = (context_enc + continuation_enc)[-(self.max_length + 1):]
            work.append((i, whole, len(continuation_enc)))
        # Longest first, so a batch holds similar lengths; results do not depend on the batching.
        work.sort(key=lambda item: -len(item[1]))
        bar = tqdm(total=len(work), disable=disable_tqdm, desc="triroute scoring", unit="req")
        for start in range(0, len(work), self.batch_size):
            chunk = work[start : start + self.batch_size]
            scored = score_batch(self.model, [w[:-1] for _, w, _ in chunk], [w[1:] for _, w, _ in chunk], audit,
                                 self.page_size)
            for (i, _, n_cont), s in zip(chunk, scored):
                answer = (float(s.logprobs[-n_cont:].sum()), bool(s.greedy[-n_cont:].all()))
                results[i] = answer
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
            bar.update(len(chunk))
        bar.close()
        if direct:
            self._log_cost("loglikelihood")
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="triroute rolling", unit="doc"):
            (string,) = request.args
            windows = [(None, *make_disjoint_window(w)) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            scored = self._loglikelihood_tokens(windows, disable_tqdm=True, audit=self.audits["loglikelihood_rolling"])
            total = sum(logprob for logprob, _ in scored)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        self._log_cost("loglikelihood_rolling")
        return out

    # -- generation ----------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy, `batch_size` requests at a time in one engine (a request's tokens do not depend
        on its batch); each stops at the end-of-document token, at `max_gen_toks`, or as soon as
        one of its `until` strings appears, and returns the text before the first stop string."""
        from ..inference.engine import InferenceEngine

        jobs = [self._generation_job(request) for request in requests]
        out: list[str] = [""] * len(jobs)
        bar = tqdm(total=len(jobs), disable=disable_tqdm, desc="triroute generating", unit="req")
        for start in range(0, len(jobs), self.batch_size):
            chunk = list(range(start, min(start + self.batch_size, len(jobs))))
            engine = InferenceEngine(self.model, page_size=self.page_size, price_curve=self.curve)
            rids = {engine.add(jobs[i][0], jobs[i][1], self._eod, *self.targets): i for i in chunk}
            while engine.running:
                engine.step()
                for rid, i in rids.items():
                    request = engine.requests[rid]
                    if not request.done and any(stop in self.tok_decode(request.generated) for stop in jobs[i][2]):
                        engine.finish(rid)
            for rid, i in rids.items():
                text = self.tok_decode(engine.requests[rid].generated)
                for stop in jobs[i][2]:
                    text = text.split(stop)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            merge_audit(self.audits["generate_until"], engine.audit)
            bar.update(len(chunk))
        bar.close()
        self._log_cost("generate_until")
        return out

    def _generation_job(self, request) -> tuple[list[int], int, list[str]]:
        """(prompt tokens, max new tokens, stop strings) of one generate_until request."""
        context, gen_kwargs = request.args
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
        if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature") or 0.0) > 0:
            raise EvaluationSetupError("'triroute' generates greedily. Fix: set do_sample: false and temperature: 0 "
                                       "in the task's generation_kwargs.")
        prompt = self.tok_encode(context) or [self.prefix_token_id]
        return prompt[-max(1, self.max_length - max_new):], max_new, until

    # -- cost report ---------------------------------------------------------------------
    def cost_report(self) -> dict:
        total = CostAudit(self.model.config.model.n_layers)
        for audit in self.audits.values():
            merge_audit(total, audit)
        report = {name: cost_dict(a) for name, a in self.audits.items() if a.tokens}
        report["all"] = cost_dict(total)
        return report

    def _log_cost(self, kind: str) -> None:
        global LAST_COST
        LAST_COST = self.cost_report()
        a = self.audits[kind]
        log.info("triroute %s: realised FLOPs %.3f, KV memory %.3f of dense over %d tokens", kind,
                 a.realised_flops(), a.realised_mem(), a.tokens)

    def get_model_info(self) -> dict:
        return {"triroute_checkpoint": self.checkpoint, "triroute_step": self.step,
                "triroute_prices": self.prices, "triroute_cost": self.cost_report(),
                "triroute_targets": {"flops": self.targets[0], "mem": self.targets[1]}}


__all__ = ["TriRouteLM", "merge_audit"]
