"""Bad inputs, fuzzed (hypothesis): configs (unknown keys, wrong types, YAML files), graph
files (syntax errors, wrong op arguments), plan.json edited by hand and dataset rows each
give one line naming the culprit (file and line where there is one) and exit 2, never a
traceback, and nothing already written is lost. The CLI runs in-process (``main``) so
each example takes a fraction of a second; examples are bounded (``max_examples``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from areal_flow.cli import main
from areal_flow.config import ExperimentConfig

REPO = Path(__file__).resolve().parents[1]
GRAPH, CONFIG = REPO / "graphs/arith_grpo.py", REPO / "graphs/arith_grpo.yaml"
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: bounded time
NAME = st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True)


def cli(*argv: str) -> tuple[int, str]:
    """``areal-flow ARGV`` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


def one_line(code: int, err: str, *culprits: str) -> str:
    """Assert exit 2 and one ``areal-flow: error:`` line holding every culprit; return it."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("areal-flow: error: "), err
    for culprit in culprits:
        assert culprit in lines[0], (culprit, lines[0])
    return lines[0]


def _leaves(cls=ExperimentConfig, prefix: str = "") -> dict[str, type]:
    """Dotted config key (as users write it) -> its type, for every leaf of the schema."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        key = prefix + ("async" if name == "async_" else name)
        out.update(_leaves(hint, key + ".") if dataclasses.is_dataclass(hint) else {key: hint})
    return out


LEAVES = _leaves()
SECTIONS = sorted({k.rsplit(".", 1)[0] for k in LEAVES if "." in k})
TYPED = sorted(k for k, t in LEAVES.items() if t in (int, float, bool))


@pytest.fixture
def kept(tmp_path) -> Path:
    """A plan written earlier: a failing command must leave it as it was."""
    path = tmp_path / "plan.json"
    path.write_text('{"earlier": true}')
    return path


@FUZZ
@given(section=st.sampled_from(["", *SECTIONS]), name=NAME, value=st.sampled_from(["1", "x", "[1]", "0.5"]))
def test_an_unknown_config_key_is_named(section, name, value, kept):
    key = f"{section}.zz{name}" if section else f"zz{name}"  # "zz": no field nor alias starts so
    code, err = cli("compile", str(GRAPH), f"{key}={value}", "--plan", "-o", str(kept))
    one_line(code, err, f"unknown config key '{key}'", "command line")
    assert kept.read_text() == '{"earlier": true}'


NOT_A_NUMBER = st.one_of(st.from_regex(r"[a-z]{2,6}!", fullmatch=True), st.lists(st.integers(), min_size=1,
                                                                                     max_size=3).map(str))


@FUZZ
@given(key=st.sampled_from(TYPED), value=NOT_A_NUMBER)
def test_a_wrongly_typed_config_value_is_named(key, value, kept):
    code, err = cli("compile", str(GRAPH), f"{key}={value}", "--plan", "-o", str(kept))
    one_line(code, err, key)
    assert kept.read_text() == '{"earlier": true}'


@FUZZ
@given(section=st.sampled_from(SECTIONS), value=st.one_of(st.integers(), NOT_A_NUMBER))
def test_a_scalar_for_a_config_section_is_named_with_its_line(section, value, tmp_path):
    path = tmp_path / "bad.yaml"
    top, _, rest = section.partition(".")
    body = f"{top}: {value}" if not rest else f"{top}:\n  {rest}: {value}"
    path.write_text(f"seed: 3\n{body}\n")
    code, err = cli("compile", str(GRAPH), "--config", str(path))
    line = 3 if rest else 2
    one_line(code, err, f"'{section}'", f"{path}:{line}")


@FUZZ
@given(text=st.text(alphabet="abc:{}[]-,'\"\n #&*!|>%@`", max_size=40))
def test_a_malformed_config_file_is_named(text, tmp_path):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    code, err = cli("graph", str(GRAPH), "--config", str(path))
    if code != 0:  # text that happens to be an empty or valid mapping compiles
        one_line(code, err, str(path))


GRAPH_LINES = GRAPH.read_text().splitlines()
BODY = [i for i, line in enumerate(GRAPH_LINES) if line.startswith("    ") and "=" in line and "(" in line]


@FUZZ
@given(junk=st.text(alphabet="x=:([{}])+*,.'\" 1", min_size=1, max_size=12), at=st.sampled_from(BODY))
def test_a_syntax_error_in_a_graph_file_names_file_and_line(junk, at, tmp_path):
    lines = list(GRAPH_LINES)
    lines.insert(at, "    " + junk)
    path = tmp_path / "graph.py"
    path.write_text("\n".join(lines) + "\n")
    try:
        compile(path.read_text(), str(path), "exec")
    except SyntaxError as exc:
        code, err = cli("graph", str(path), "--config", str(CONFIG))
        one_line(code, err, str(path), f"line {exc.lineno}")
        return
    code, err = cli("graph", str(path), "--config", str(CONFIG))  # valid Python: may trace or fail naming the file
    if code != 0:
        one_line(code, err, str(path))


OP_GRAPH = """from areal_flow import Model, flow, ops


@flow
def fuzzed(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples={n}, max_new_tokens={m}{extra})
    adv = ops.advantage(rollout, ops.reward(rollout, fn="arithmetic"), estimator={est})
    stats = ops.train_step(policy, adv, algorithm={algo}, max_staleness={k})
    ops.sync_weights(policy, to=rollout)
    return stats
"""
ARG = st.one_of(st.integers(-2, 3), st.sampled_from(["'grpo'", "'ppo'", "'nope'", "None", "1.5", "[]", "'x'"]))


@FUZZ
@given(n=ARG, m=ARG, est=ARG, algo=ARG, k=ARG, extra=st.sampled_from(["", ", bogus=1", ", temperature='hot'"]))
def test_wrong_op_arguments_name_the_graph_file_and_line(n, m, est, algo, k, extra, tmp_path):
    path = tmp_path / "ops_graph.py"
    path.write_text(OP_GRAPH.format(n=n, m=m, est=est, algo=algo, k=k, extra=extra))
    code, err = cli("compile", str(path), "--config", str(CONFIG))
    if code != 0:
        line = one_line(code, err)
        if str(path) in line:  # a graph error: file and line of the op call
            assert re.search(re.escape(str(path)) + r":\d+", line), line
        else:  # a config-level refusal of what the graph asked for names the key or node
            assert re.search(r"'[\w.]+'|\w+\.\w+=", line), line


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    code, err = cli("compile", str(GRAPH), "--plan", "-o", str(out))
    assert code == 0, err
    return out.read_text()


FREE_FORM = {"attrs", "times", "memory", "workload", "device"}
"""Mappings the plan carries for their readers (node executors, the simulator), not checked on load."""


def _paths(value, prefix=()) -> list[tuple]:
    """Every path into a JSON value (dict keys, list indices), free-form mappings left out."""
    out = [prefix] if prefix else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        if key not in FREE_FORM:
            out.extend(_paths(child, (*prefix, key)))
    return out


JSON_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(["", "x", "gen:d1"]),
                       st.just([]), st.just({}), st.just(["x"]), st.just([["a", "b"]]))


@FUZZ
@given(data=st.data())
def test_a_hand_edited_plan_is_loaded_or_refused_naming_the_file(plan_text, data, tmp_path):
    from compiler.plan import Plan, PlanSchemaError

    plan = json.loads(plan_text)
    where = data.draw(st.sampled_from(_paths(plan)))
    parent = plan
    for key in where[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[where[-1]]
    else:
        parent[where[-1]] = data.draw(JSON_VALUE)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(plan))
    before = path.read_text()
    try:  # what 'run --plan', 'simulate' and 'viz' read it with; the CLI prints the error as one line
        Plan.from_json(before, source=str(path))
    except PlanSchemaError as exc:
        assert str(exc).startswith(f"{path}: ") and len(str(exc).splitlines()) == 1, str(exc)
    assert path.read_text() == before


def test_a_plan_error_reaches_the_terminal_as_one_line(plan_text, tmp_path):
    plan = json.loads(plan_text)
    plan["nodes"][1]["mesh"]["n_devices"] = "2"  # a hand edit: a string where an int goes
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    code, err = cli("simulate", str(path), "--steps", "2")
    one_line(code, err, f"{path}: plan node '{plan['nodes'][1]['name']}': mesh.n_devices='2' is not int")


ROW = st.fixed_dictionaries({}, optional={"question": st.one_of(st.text(max_size=8), st.integers()),
                                          "answer": st.one_of(st.sampled_from(["#### 4", "4", "#### x", "## 1"]),
                                                              st.integers())})


@FUZZ
@given(rows=st.lists(st.one_of(ROW.map(json.dumps), st.sampled_from(["{", "[1]", "nope", '"s"'])), min_size=1,
                     max_size=4))
def test_a_bad_dataset_row_is_named_by_file_and_line(rows, tmp_path):
    from areal_flow.tasks.gsm8k import read_gsm8k_jsonl

    good = json.dumps({"question": "1+1?", "answer": "#### 2"})
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([good, *rows]) + "\n")
    try:
        problems = read_gsm8k_jsonl(path)
    except ValueError as exc:
        assert re.match(re.escape(str(path)) + r"(:\d+|\[\d+\])?: ", str(exc)), str(exc)
        assert len(str(exc).splitlines()) == 1
        return
    assert problems[0] == {"prompt": "1+1?", "answer": "2", "id": 0}
