"""The harness end to end, offline: a small multiple-choice task (YAML + JSON lines written
here) through `lm_eval.simple_evaluate` with the `triroute` model, and through the harness's own
command line (`python -m megatron_triroute.lm_eval_harness`). Its accuracy equals the one computed
by hand from the model's log-likelihoods of each choice, and the realised cost is in the results."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from megatron_triroute.evaluation.harness import TriRouteLM  # noqa: E402
from tests.training.conftest import REPO  # noqa: E402

DOCS = [
    {"question": "The river runs through the", "choices": ["town", "blue", "of"], "answer": 0},
    {"question": "def main():\n   ", "choices": [" return 0", " the the", " river"], "answer": 0},
    {"question": "The history of the city is", "choices": ["long", "def", ")"], "answer": 1},
    {"question": "It was built in the year", "choices": ["of", "1900", "and"], "answer": 2},
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_task")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "tiny_choice.yaml").write_text(textwrap.dedent(f"""\
        task: tiny_choice
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """))
    return root


def offline_env(tmp_path):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def hand_accuracy(checkpoint) -> float:
    """Accuracy from the model's own log-likelihoods: the harness's multiple-choice request is
    (question, " " + choice) for each choice, the answer the argmax."""
    lm = TriRouteLM(checkpoint=str(checkpoint))
    correct = 0
    for doc in DOCS:
        requests = [Instance("loglikelihood", {}, (doc["question"], " " + c), i) for i, c in enumerate(doc["choices"])]
        values = [v for v, _ in lm.loglikelihood(requests, disable_tqdm=True)]
        correct += int(max(range(len(values)), key=values.__getitem__) == doc["answer"])
    return correct / len(DOCS)


SCRIPT = """
import json, sys
checkpoint, tasks_dir, out_dir = sys.argv[1:4]
import lm_eval, lm_eval.tasks

class LocalTasks(lm_eval.tasks.TaskManager):
    # Index only the test's task directory: the built-in index (thousands of YAML files) takes
    # about a minute on a loaded 2-core machine and is not what is under test.
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **dict(kwargs, include_defaults=False))

lm_eval.tasks.TaskManager = LocalTasks
import megatron_triroute.evaluation.harness  # registers "triroute"

results = lm_eval.simple_evaluate(model="triroute", model_args="checkpoint=" + checkpoint, tasks=["tiny_choice"],
                                  task_manager=LocalTasks(include_path=tasks_dir), batch_size=2)
print("SIMPLE " + json.dumps({"results": results["results"], "cost": results["config"]["triroute_cost"]}))

# The harness's own command line through the wrapper, in the same process.
from megatron_triroute import lm_eval_harness
sys.argv = ["lm_eval_harness", "run", "--model", "triroute", "--model_args", "checkpoint=" + checkpoint,
            "--tasks", "tiny_choice", "--include_path", tasks_dir, "--batch_size", "1", "--output_path", out_dir]
lm_eval_harness.main()
"""


def test_simple_evaluate_and_the_cli(trained_run, task_dir, tmp_path):
    checkpoint = trained_run / "checkpoints"
    expected = hand_accuracy(checkpoint)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(checkpoint), str(task_dir), str(tmp_path / "out")],
                         cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    simple = [line for line in out.stdout.splitlines() if line.startswith("SIMPLE ")]
    result = json.loads(simple[0][len("SIMPLE "):])
    assert result["results"]["tiny_choice"]["acc,none"] == pytest.approx(expected, abs=1e-12)
    cost = result["cost"]["loglikelihood"]
    assert cost["tokens"] > 0 and 0 < cost["realised_flops"] < 1.5 and 0 < cost["realised_mem"] < 1

    cli_output = out.stdout.split(simple[0], 1)[1]
    assert "tiny_choice" in cli_output and "triroute realised cost" in cli_output
    saved = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("results_*.json")]
    assert len(saved) == 1
    assert saved[0]["results"]["tiny_choice"]["acc,none"] == pytest.approx(expected, abs=1e-12)
    # A new model instance per run: the same requests, the same cost (batch size 1 vs 2).
    assert saved[0]["config"]["triroute_cost"]["loglikelihood"] == pytest.approx(cost)
