"""A generation error of one request (``runtime.executors.generate``): that sample fails like
a failed reward (left out, its group resampled when empty, counted, logged once), the
worker lives on, and past ``reward.max_failure_fraction`` the run stops with one line.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from areal_flow.rewards.pool import FailureFractionError


def _executor(monkeypatch, tmp_path, fraction: float, window: int):
    from test_reliability import _random_tiny

    import runtime.executors.generate as generate
    from runtime.engines.generation import GenerationEngine

    model, tok = _random_tiny(tmp_path)
    monkeypatch.setattr(generate, "build_engine", lambda node, ctx: GenerationEngine(model, tok, max_batch_size=8))
    attrs = dict(n_samples=2, temperature=1.0, top_p=1.0, max_new_tokens=3, chat_template=False,
                 max_failure_fraction=fraction, failure_window=window)
    node = SimpleNamespace(name="generate", attrs=attrs)
    return generate.GenerateExecutor(node, SimpleNamespace(tokenizer=tok)), model.config.max_position_embeddings


def _problem(prompt: str) -> dict:
    return {"prompt": prompt, "answer": "17", "id": prompt[:8]}


def test_a_refused_request_fails_its_sample_and_the_worker_goes_on(monkeypatch, tmp_path):
    torch.set_num_threads(1)
    gen, context = _executor(monkeypatch, tmp_path, fraction=0.5, window=200)
    gen.submit(0, 1, _problem("12+5="))
    gen.submit(1, 1, _problem("1" * context))  # + <bos>: longer than the context, both requests refused
    finished = {}
    while gen.has_work():
        finished.update({(i, a): t for i, a, t in gen.step()})
    assert len(finished[(1, 1)]) == 0  # an empty group: the replica reports it dropped, its slot is resampled
    assert len(finished[(0, 1)]) == 2 and {t.group_id for t in finished[(0, 1)]} == {0}
    assert gen.counts == {"empty_responses": 0, "generation_errors": 2}
    assert gen.monitor.kinds == {"generation error (RequestRefused)": 2}


def test_generation_errors_past_the_fraction_stop_the_run(monkeypatch, tmp_path):
    torch.set_num_threads(1)
    gen, context = _executor(monkeypatch, tmp_path, fraction=0.5, window=4)
    gen.submit(0, 1, _problem("1" * context))  # failures 2 of 2: 2 > 0.5 * 4 is false, goes on
    with pytest.raises(FailureFractionError, match=r"generate node 'generate': 3 of the last 3 samples failed .*"
                                                   r"generation error \(RequestRefused\) x3; first: sample 0:0: "
                                                   r"runtime\.engines\.generation\.RequestRefused: request '0:0': prompt of"):
        gen.submit(1, 1, _problem("1" * context))  # the third failure: 3 > 2


def test_prompts_longer_than_the_plans_budget_run_and_are_counted_once_said(monkeypatch, tmp_path, capsys):
    """``compile.max_prompt_len`` sized the plan; a longer prompt still runs, is counted in the
    replica's report and said once on stderr, naming the node and the key."""
    torch.set_num_threads(1)
    from test_reliability import _random_tiny

    import runtime.executors.generate as generate
    from areal_flow.ops.generate import encode_prompt
    from runtime.engines.generation import GenerationEngine

    model, tok = _random_tiny(tmp_path)
    monkeypatch.setattr(generate, "build_engine", lambda node, ctx: GenerationEngine(model, tok, max_batch_size=8))
    attrs = dict(n_samples=2, temperature=1.0, top_p=1.0, max_new_tokens=2, chat_template=False)
    node = SimpleNamespace(name="generate", attrs=attrs, where=lambda: "node 'generate' (generate, g.py:9)")
    plan = SimpleNamespace(workload={"prompt_len": 6}, nodes=[])
    gen = generate.GenerateExecutor(node, SimpleNamespace(tokenizer=tok, plan=plan))
    prompts = ["1+2=", "12+34=", "123+456=", "12+3="]  # characters; the tokenizer adds <bos>: 5, 7, 9, 6 tokens
    assert [len(encode_prompt(tok, p, False)) for p in prompts] == [5, 7, 9, 6]
    for i, p in enumerate(prompts):
        gen.submit(i, 1, _problem(p))
    finished = {}
    while gen.has_work():
        finished.update({i: t for i, _, t in gen.step()})
    assert sorted(finished) == [0, 1, 2, 3] and all(len(t) == 2 for t in finished.values())  # every group ran
    report = gen.report()
    assert report["prompts_over_budget"] == 2 and report["longest_prompt"] == 9  # 7 and 9 > 6
    err = capsys.readouterr().err
    assert err.count("tokens the plan was sized for") == 1
    assert "node 'generate' (generate, g.py:9): a prompt of 7 tokens is longer than the 6 tokens" in err
    assert "compile.max_prompt_len" in err
    # without a plan's workload (an old plan, a bare executor) nothing is checked or reported
    bare = generate.GenerateExecutor(node, SimpleNamespace(tokenizer=tok))
    bare.submit(0, 1, _problem("123+456="))
    assert "prompts_over_budget" not in bare.report()
