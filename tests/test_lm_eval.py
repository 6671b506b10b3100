"""lm-evaluation-harness itself against `k2jax serve --demo` on a loopback port, as a user checks a deployment:

- a multiple-choice task, scored by loglikelihood through `local-completions` (echo + logprobs over token ids,
  the tokenizer read from the server: /tokenizer_info, /tokenize, /detokenize);
- a generate_until task through `local-chat-completions` with the chat template applied.

Both are local task files over a few local JSONL rows (nothing is downloaded). The demo model has random
weights, so accuracy is chance: the tests check that the harness runs to the end and reports its metrics, and
that each choice's loglikelihood is the server's own sum of the continuation's prompt logprobs.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.serve_util import demo_server

QUESTIONS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["three", "four", "a fish"], "answer": 1},
    {"question": "Water freezes into", "choices": ["steam", "sand", "ice"], "answer": 2},
    {"question": "A cat says", "choices": ["meow", "moo"], "answer": 0},
]
CHOICE_TASK = """task: k2jax_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: k2jax_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def demo():
    with demo_server("--max-batch", "4", "--max-len", "256", "--prefill-chunk", "64") as port:
        yield port


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    data = d / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (d / "k2jax_choice.yaml").write_text(CHOICE_TASK.format(data=data))
    (d / "k2jax_gen.yaml").write_text(GEN_TASK.format(data=data))
    return d


def _lm_eval(tmp_path, tasks, task, model, model_args, *extra):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
        "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
        "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": "x"}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
           "--tasks", task, "--include_path", str(tasks), "--output_path", str(out), "--log_samples", *extra]
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    results = sorted(out.rglob("results_*.json"))
    samples = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    assert results and samples, (list(out.rglob("*")), p.stderr[-3000:])
    res = json.loads(results[-1].read_text())["results"][task]
    return res, [json.loads(line) for line in samples[-1].read_text().splitlines()]


def test_loglikelihood_task_through_local_completions(demo, tasks, tmp_path):
    import openai

    base = f"http://127.0.0.1:{demo}/v1"
    res, samples = _lm_eval(tmp_path, tasks, "k2jax_choice", "local-completions",
                            f"base_url={base}/completions,model=k2jax-demo,tokenizer_backend=remote,"
                            "num_concurrent=2,max_retries=1,timeout=300")
    assert 0.0 <= res["acc,none"] <= 1.0 and "acc_stderr,none" in res  # chance: random weights
    assert len(samples) == len(QUESTIONS)
    # each choice's loglikelihood is the sum of its continuation's prompt logprobs, as the server gives them
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    s = samples[1]  # arguments {"gen_args_i": {"arg_0": context, "arg_1": continuation}}; resps as strings
    for args, resp in zip(s["arguments"].values(), s["resps"]):
        ctx, cont, ll = args["arg_0"], args["arg_1"], float(resp[0][0])
        whole = client.completions.create(model="k2jax-demo", prompt=ctx + cont, max_tokens=0, echo=True,
                                          logprobs=0).choices[0].logprobs
        n_ctx = len(client.completions.create(model="k2jax-demo", prompt=ctx, max_tokens=0, echo=True,
                                              logprobs=0).choices[0].logprobs.tokens)
        assert abs(sum(whole.token_logprobs[n_ctx:]) - ll) < 1e-3, (ctx, cont, ll)


def test_generate_until_task_through_local_chat_completions(demo, tasks, tmp_path):
    res, samples = _lm_eval(tmp_path, tasks, "k2jax_gen", "local-chat-completions",
                            f"base_url=http://127.0.0.1:{demo}/v1/chat/completions,model=k2jax-demo,"
                            "num_concurrent=2,max_retries=1,timeout=300", "--apply_chat_template")
    assert 0.0 <= res["exact_match,none"] <= 1.0  # chance: random weights
    assert len(samples) == len(QUESTIONS) and all(isinstance(s["resps"][0][0], str) for s in samples)
