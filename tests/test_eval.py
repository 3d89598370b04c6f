"""`jaxpar eval`, train.eval_tasks and evaluate_model: lm-eval's tasks on jaxpar's model.

The reference is lm-eval's own Hugging Face backend, run in another environment (torch, transformers) on
the model in fixtures/eval/model (a 2-layer Llama trained 300 steps on the facts of configs/evals' two tasks,
then exported): fixtures/eval/golden.json holds each request's log-likelihood and each generated answer
(tests/fixtures/eval/make_fixtures.py made them all). jaxpar must give every log-likelihood within 1e-4 and
the same answers on each layout, so the same accuracies. A choice that comes out otherwise is allowed only
where the reference itself nearly tied (its margin below the tolerance): none does on this model.
"""

import json
from pathlib import Path

import pytest
from helpers import train_here

from jaxpar.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
MODEL = FIXTURES / "model"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())
TASKS = "colors_mc,colors_qa,colors_text"
TOLERANCE = 1e-4
# colors_text's log-likelihoods are sums over whole texts, near -1000, where the reference's fp32 sums are
# spaced 6e-5 apart: they are compared relative to their size instead (measured: 8.8e-8 at most)
RELATIVE = 1e-6


def eval_here(capsys, *args: str) -> tuple[int, str, str]:
    """`jaxpar eval` in this process: exit code, stdout (the summary's JSON line), stderr."""
    code = main(["eval", *args, "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def by_doc(samples: list[dict]) -> list[dict]:
    return sorted(samples, key=lambda s: s["doc_id"])


def assert_agrees_with_the_reference(results: dict) -> None:
    """Per request: log-likelihoods within TOLERANCE and the same is-greedy; per question: the same answer;
    per task: the same metrics (what a near-tie of the reference could change is judged by its margin)."""
    for doc, reference in zip(by_doc(results["samples"]["colors_mc"]), GOLDEN["requests"]["colors_mc"], strict=True):
        ours = [r[0][0] for r in doc["resps"]]
        theirs = [r[0][0] for r in reference]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= TOLERANCE, (doc["doc_id"], ours, theirs)
        assert [r[0][1] for r in doc["resps"]] == [r[0][1] for r in reference]
        if ours.index(max(ours)) != theirs.index(max(theirs)):
            top, second = sorted(theirs)[-2:][::-1]
            assert top - second < 2 * TOLERANCE, f"document {doc['doc_id']} chose otherwise with a margin"
    answers = [d["resps"][0][0] for d in by_doc(results["samples"]["colors_qa"])]
    for i, (ours, theirs, margin) in enumerate(zip(answers, GOLDEN["requests"]["colors_qa"], GOLDEN["margins"])):
        assert ours == theirs[0][0] or margin < TOLERANCE, (i, ours, theirs, margin)
    texts = [d["resps"][0][0] for d in by_doc(results["samples"]["colors_text"])]
    assert texts == pytest.approx([r[0][0] for r in GOLDEN["requests"]["colors_text"]], rel=RELATIVE, abs=0)
    for task, metrics in GOLDEN["results"].items():
        ours = {k: v for k, v in results["results"][task].items() if k != "alias"}
        assert ours.keys() == metrics.keys()
        # the accuracies exactly; their standard errors are the same sums in another order, and the perplexities
        # exponents of the texts' sums
        exact = {k for k in metrics if "_stderr" not in k and task != "colors_text"}
        assert {k: ours[k] for k in exact} == {k: metrics[k] for k in exact}
        rest = metrics.keys() - exact - {"name", "sample_len"}
        assert {k: ours[k] for k in rest} == pytest.approx({k: metrics[k] for k in rest}, rel=RELATIVE)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["mesh.data=8"], ["mesh.data=4", "mesh.tensor=2"]], ids=" x ".join)
def test_jaxpar_eval_agrees_with_lm_evals_hf_backend(layout, capsys, tmp_path):
    out = tmp_path / "results.json"
    code, stdout, err = eval_here(capsys, str(MODEL), *layout, "--tasks", TASKS, "--out", str(out), "--log-samples",
                                  "--max-length", "128")  # the reference's max_length
    assert code == 0, err
    assert_agrees_with_the_reference(json.loads(out.read_text()))
    summary = json.loads(stdout)
    assert summary["requests"] == 4 * 50 + 50 + 10 and summary["layout"] == " ".join(layout).replace("mesh.", "")
    assert summary["tasks"]["colors_qa"] == {"exact_match": GOLDEN["results"]["colors_qa"]["exact_match,none"]}
    assert f"colors_mc acc {GOLDEN['results']['colors_mc']['acc,none']:.4f}" in err


@pytest.mark.slow
def test_evaluate_model_on_a_live_model_on_one_device_agrees_too():
    """The Python API: the model as transformers' loader gives it to jaxpar, its weights on one device."""
    from jaxpar.evals.command import evaluate_model
    from jaxpar.interop import hf

    model, cfg = hf.load(MODEL)
    assert_agrees_with_the_reference(evaluate_model(model, cfg, TASKS, tokenizer=MODEL, log_samples=True))


IN_LOOP = ["train.eval_tasks=colors_mc,colors_qa", "train.eval_tasks_every=50", "train.eval_tasks_limit=10",
           "train.log_every=25", "train.lr_schedule_steps=100"]


def task_rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows if "eval/colors_mc/acc" in r}


@pytest.mark.slow
def test_in_loop_tasks_log_at_50_and_100_a_resume_repeats_them_and_jaxpar_eval_agrees(capsys, tmp_path):
    """A byte model of the built-in corpus: its answers are poor, but they are the same however it gets there."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train_here(capsys, whole, *IN_LOOP, "train.steps=100")[0] == 0
    logged = task_rows(whole)
    assert sorted(logged) == [50, 100]
    assert set(logged[50]) == {"eval/colors_mc/acc", "eval/colors_mc/acc_norm", "eval/colors_qa/exact_match"}
    assert train_here(capsys, cut, *IN_LOOP, "train.steps=50", "checkpoint.every=50")[0] == 0
    assert train_here(capsys, cut, *IN_LOOP, "train.steps=100")[0] == 0
    assert task_rows(cut) == logged
    code, stdout, err = eval_here(capsys, str(whole), "--tasks", "colors_mc,colors_qa", "--limit", "10", "mesh.data=4",
                                  "mesh.tensor=2")
    assert code == 0, err
    assert json.loads(stdout)["out"] == str(whole / "eval" / "results-step100.json")
    assert {f"eval/{task}/{metric}": value for task, metrics in json.loads(stdout)["tasks"].items()
            for metric, value in metrics.items()} == logged[100]


BAD_TASK = """task: unreadable
dataset_path: json
dataset_kwargs:
  data_files:
    test: not_here.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{q}}"
doc_to_choice: ["a", "b"]
doc_to_target: 0
"""


@pytest.mark.parametrize("tasks, words", [
    pytest.param("hellaswg", "lm-eval has no task 'hellaswg'; the closest are hellaswag",
                 marks=pytest.mark.slow),  # lm-eval's index of its tasks takes seconds to build
    pytest.param("hellaswag", "the dataset of task hellaswag cannot be read (Couldn't reach 'Rowan/hellaswag' on the "
                              "Hub", marks=pytest.mark.slow),  # the index again, and datasets' look at the hub
    ("{bad}", "the dataset of task {bad} cannot be read (Unable to find '{folder}/not_here.jsonl')"),
    ("missing.yaml", "the task file missing.yaml does not exist."),
    ("{malformed}", "the task file {malformed} cannot be read (while parsing a flow mapping)."),
], ids=["unknown name", "a hub dataset offline", "a local file that is not there", "no such task file", "not YAML"])
def test_a_task_that_cannot_run_is_one_sentence_before_the_model_loads(tasks, words, capsys, tmp_path, monkeypatch):
    (tmp_path / "bad.yaml").write_text(BAD_TASK)
    (tmp_path / "malformed.yaml").write_text("task: x\ndoc_to_text: {{q}\nnot yaml\n")
    names = {"bad": str(tmp_path / "bad.yaml"), "malformed": str(tmp_path / "malformed.yaml"), "folder": tmp_path}
    monkeypatch.setattr("jaxpar.evals.command.load_model", None)  # reaching the model would fail otherwise
    code, stdout, err = eval_here(capsys, str(MODEL), "--tasks", tasks.format(**names))
    assert code == 2 and stdout == ""
    assert err.startswith("jaxpar: error: " + words.format(**names)) and err.count("\n") == 1


def test_a_generation_that_leaves_no_room_for_its_context_is_one_sentence_before_any_task_runs(capsys):
    code, stdout, err = eval_here(capsys, str(MODEL), "--tasks", "colors_mc,colors_qa", "--max-length", "8",
                                  "mesh.data=1", "run.devices=1")
    assert code == 2 and stdout == ""
    assert err == ("jaxpar: error: task colors_qa asks for 8 new tokens, but requests run at 8 tokens at most "
                   "(--max-length; a run's model.seq_len).\n")


def test_without_lm_eval_eval_and_in_loop_tasks_are_one_sentence(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("jaxpar.features.evals.find_spec", lambda name: None)
    code, _, err = eval_here(capsys, str(MODEL), "--tasks", TASKS)
    assert code == 2 and err == "jaxpar: error: jaxpar eval needs lm-eval, which is not installed: pip install " \
                                "'jaxpar[eval]'.\n"
    code, err = train_here(capsys, tmp_path / "run", "train.eval_tasks=colors_mc")
    assert code == 2 and "train.eval_tasks needs lm-eval" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("settings, words", [
    (["train.eval_tasks_every=50"], "train.eval_tasks_every and train.eval_tasks_limit set how train.eval_tasks run"),
    (["train.eval_tasks=colors_mc", "train.eval_tasks_every=-1"], "train.eval_tasks_every must be 0 or positive"),
    (["train.eval_tasks=nowhere.yaml"], "train.eval_tasks names the task file nowhere.yaml, which does not exist"),
    (["train.eval_tasks=colors_mc", "mesh.stage=2", "mesh.tensor=1"], "train.eval_tasks runs on meshes without stages"),
])
def test_in_loop_task_settings_that_cannot_work_are_one_sentence(settings, words, capsys, tmp_path):
    code, err = train_here(capsys, tmp_path / "run", *settings)
    assert code == 2 and words in err and not (tmp_path / "run").exists()


def test_a_hugging_face_checkpoint_runs_at_its_context_as_lm_evals_backend_reads_it(tmp_path):
    from jaxpar.evals.command import DEFAULT_CONTEXT, hf_context_length

    assert hf_context_length(MODEL) == json.loads((MODEL / "config.json").read_text())["max_position_embeddings"]
    composite = {"text_config": {"max_position_embeddings": 32768}, "max_position_embeddings": 1200}
    for config, length in ((composite, 32768), ({"n_positions": 1024}, 1024), ({}, DEFAULT_CONTEXT)):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert hf_context_length(tmp_path) == length
