"""The sandboxed Python tool (``areal_flow.envs.sandbox``) and the ``python_math`` env:
output, the limits against hostile code, and episodes that go on after a tool error."""

from __future__ import annotations

import json
import os
import time

import pytest

from areal_flow.envs import EnvError, make_env
from areal_flow.envs.sandbox import run_python
from areal_flow.envs.tools import ToolCall
from runs import REPO, cli_run, records


def test_output_is_returned_and_the_folder_deleted():
    result = run_python("import os\nprint(6 * 7)\nprint(os.getcwd())")
    out, folder = result.stdout.split("\n")[:2]
    assert out == "42" and result.exit_code == 0 and not result.timed_out and not result.truncated
    assert not os.path.exists(folder)
    assert result.observation(5.0) == f"42\n{folder}"


def test_an_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.5, cpu_s=30)
    assert time.monotonic() - start < 1.5 + 2.0
    assert result.timed_out and result.exit_code is None
    assert "timed out after 1.5 s" in result.observation(1.5)


def test_the_cpu_limit_stops_a_busy_loop_before_the_wall_clock():
    result = run_python("while True:\n    pass", timeout_s=20, cpu_s=1)
    assert not result.timed_out and result.exit_code < 0
    assert "SIGXCPU (CPU limit)" in result.observation(20) or "SIGKILL" in result.observation(20)


def test_the_whole_process_group_is_killed():
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n"
            "print(pid, flush=True)\nwhile True:\n    pass")
    result = run_python(code, timeout_s=1.5, max_processes=2)
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "\nState:\tZ" in f.read():
                    break  # dead, not yet reaped by init
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the forked child {pid} outlived the timeout")


def test_a_memory_bomb_gets_memory_error():
    result = run_python("x = bytearray(8 * 1024 ** 3)", memory_mb=256)
    assert "MemoryError" in result.stderr and result.exit_code == 1 and not result.timed_out


def test_a_fork_bomb_is_refused():
    probe = run_python("import os\nos.fork()")
    if "BlockingIOError" not in probe.stderr:
        pytest.skip("RLIMIT_NPROC is not enforced here; a real fork bomb would hurt the machine")
    start = time.monotonic()
    result = run_python("import os\nwhile True:\n    os.fork()", timeout_s=5)
    assert "BlockingIOError" in result.stderr and time.monotonic() - start < 5


def test_output_is_truncated():
    result = run_python("print('a' * 5000)", max_output=100)
    assert result.stdout == "a" * 100 and result.truncated
    assert result.observation(5).endswith("[output truncated]")
    flood = run_python("while True:\n    print('y' * 10000)", timeout_s=10, max_output=50)  # stops at RLIMIT_FSIZE
    assert flood.truncated and not flood.timed_out and len(flood.stdout) == 50


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="bad limits"):
        run_python("print(1)", timeout_s=0)


def _env(**config):
    return make_env("python_math", {"prompt": "what is 2 + 3?", "answer": "5", **config})


def test_the_episode_goes_on_after_tool_errors_and_ends_with_the_answer():
    env = _env(python_timeout_s=1.5)
    assert env.reset() == "what is 2 + 3?" and env.action_space == "tool_call"
    obs, reward, done, info = env.step('python("1/0")')
    assert "ZeroDivisionError" in obs and not done and reward == 0.0 and info["python_errors"] == 1
    obs, _, done, info = env.step(ToolCall("python", {"code": "while True:\n    pass"}))
    assert "timed out" in obs and not done and info["python_errors"] == 1
    obs, _, done, info = env.step("python(")
    assert obs.startswith("error:") and not done and info["tool_error"] == 1
    obs, _, done, info = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(2 + 3)"}}</tool_call>')
    assert obs == "5" and not done and info == {"success": 0, "python_calls": 1, "python_errors": 0, "tool_error": 0}
    _, reward, done, info = env.step("answer(5)")
    assert done and reward == 1.0 and info["success"] == 1


def test_a_plain_text_turn_is_the_final_answer():
    assert _env().step("the answer is 6")[1:3] == (0.0, True)
    assert _env(turn_cost=0.1).step('python("print(1)")')[1] == -0.1


def test_bad_env_config_is_refused():
    with pytest.raises(EnvError, match="answer is missing"):
        make_env("python_math", {"prompt": "q"})
    with pytest.raises(EnvError, match="python_timeout_s"):
        _env(python_timeout_s=0)


@pytest.mark.slow
def test_python_math_plays_in_a_run(tmp_path):
    # graphs/arith_python_tool.py, two steps: the env plays in the rollout loop, the warm start
    # on tool-using dialogues (tasks/tool_multiply.py) included.
    cli_run(REPO / "graphs" / "arith_python_tool.py", "train.steps=2", "train.batch_size=2", "gen.n_samples=2",
            "warm_start.steps=10", "eval.n_test=4", f"out_dir={tmp_path}")
    rows = records(tmp_path / "arith_python_tool")
    assert len(rows) == 2 * 2 * 2 and all(r["prompt_text"].endswith("=") for r in rows)
    assert {r["reward"] for r in rows} <= {0.0, 1.0}  # no turn cost: the final answer's 1 or 0
    summary = json.loads((tmp_path / "arith_python_tool" / "summary.json").read_text())
    assert summary["episodes"]["played"] >= 8 and summary["episodes"]["failed"] == 0
    assert "env/python_calls" in summary["episodes_after"]
