"""The agent endpoint under the load its own example puts on it, and failed episodes
summarized: one line and a count per distinct error, in the run summary, tracebacks in
the run folder's log."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

import yaml

from runtime.engines.generation import SamplingParams
from runtime.executors.episode_failures import EpisodeFailures
from runtime.executors.episode_runner import EpisodeRunner
from runtime.metrics import episode_summary, format_summary
from runs import REPO
from test_agent_endpoint import ATTRS, FakeEngine, chat_tokenizer


def drive(agent, n_groups: int, n_samples: int, limit_s: float, failure_log=None, **attrs) -> EpisodeRunner:
    """Submit ``n_groups`` groups of ``n_samples`` episodes of ``agent`` at once; step the runner
    until all ended (at most ``limit_s`` seconds)."""
    runner = EpisodeRunner(FakeEngine(), chat_tokenizer(), {**ATTRS, "agent": agent, "n_samples": n_samples, **attrs},
                           SamplingParams(temperature=1.0, max_new_tokens=4), max_context=64,
                           failure_log=failure_log)
    started = time.monotonic()
    try:
        for i in range(n_groups):
            runner.submit(i, 1, {"id": i})
        while runner.has_work():
            assert time.monotonic() - started < limit_s, "episodes did not finish"
            runner.step()
    finally:
        runner.close()
    return runner


def test_the_endpoint_holds_every_episode_of_the_example_connecting_at_once():
    """Every episode the example keeps in flight connects at the same instant and makes its two
    calls; none fails (Python's default listen backlog of 5 reset most of them), and both
    calls of an episode travel on one keep-alive connection."""
    cfg = yaml.safe_load((REPO / "graphs/arith_openai_agent.yaml").read_text())
    groups = (cfg["async"]["max_staleness"] + 1) * cfg["train"]["batch_size"]  # admitted before version 1
    n = cfg["gen"]["n_samples"]
    assert groups * n == 3 * 16 * 8  # the example's numbers, read by hand
    gate = threading.Barrier(groups * n, timeout=60)
    statuses, reused = Counter(), Counter()

    def agent(base_url: str, row: dict) -> float:
        url = urlsplit(base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        messages, sockets = [{"role": "user", "content": "3+4="}], []
        gate.wait()  # all at once
        for _ in range(2):
            conn.request("POST", url.path + "/chat/completions", json.dumps({"messages": messages}),
                         {"Content-Type": "application/json"})
            sockets.append(conn.sock)
            reply = conn.getresponse()
            body = json.loads(reply.read())
            statuses[reply.status] += 1
            messages += [body["choices"][0]["message"], {"role": "user", "content": "again="}]
        conn.close()
        reused[sockets[0] is sockets[1]] += 1
        return 1.0

    runner = drive(agent, groups, n, limit_s=90, step_timeout_s=60.0)
    assert runner.counts["episodes"] == 384 and runner.counts["episodes_failed"] == 0
    assert statuses == {200: 2 * 384}
    assert reused == {True: 384}


def test_a_refused_request_leaves_its_keep_alive_connection_usable():
    """The body of a request answered with an error (here: no episode in its path) is read all
    the same, so the next request on the connection is parsed from its own first byte."""
    seen = []

    def agent(base_url: str, row: dict) -> float:
        url = urlsplit(base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        bad = json.dumps({"messages": [{"role": "user", "content": "x" * 100}]})
        conn.request("POST", "/v1/chat/completions", bad, {"Content-Type": "application/json"})
        sock = conn.sock  # http.client drops it once a response says the server closes
        first = conn.getresponse()
        seen.append((first.status, json.loads(first.read())["error"]["code"], sock))
        good = json.dumps({"messages": [{"role": "user", "content": "1"}]})
        conn.request("POST", url.path + "/chat/completions", good, {"Content-Type": "application/json"})
        sock = conn.sock
        second = conn.getresponse()
        seen.append((second.status, json.loads(second.read())["choices"][0]["message"]["content"], sock))
        return 1.0

    runner = drive(agent, 1, 1, limit_s=20)
    assert runner.counts["episodes_failed"] == 0
    (s1, code, sock1), (s2, content, sock2) = seen
    assert (s1, code, s2, content) == (404, "not_found", 200, "7") and sock1 is sock2


def test_failed_episodes_are_one_line_per_distinct_error_with_counts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # where the lines name this file from
    source = (REPO / "tests/test_agent_load.py").read_text().splitlines()
    broke = 1 + [s.strip() for s in source].index('raise RuntimeError("agent broke")')
    div = 1 + [s.strip() for s in source].index("return 1 / 0")

    def agent(base_url: str, row: dict):
        if row["id"] in (0, 1):  # one group: 2 episodes each
            raise RuntimeError("agent broke")
        if row["id"] == 2:
            return 1 / 0
        if row["id"] == 3:
            time.sleep(3)  # more than step_timeout_s before its first call
        return None  # no chat call: fails after the endpoint's check, at the runner's line

    log = tmp_path / "episode_failures.log"
    runner = drive(agent, 5, 2, limit_s=30, step_timeout_s=1.0, failure_log=log)
    here = "tests/test_agent_load.py"
    silent = [line for line in runner.failures.counts if "without a chat completion call" in line]
    assert len(silent) == 1 and silent[0].endswith("in _play_agent)")  # not the test's: the runner raised it
    assert runner.failures.counts == {
        f"RuntimeError: agent broke ({here}:{broke} in agent)": 4,
        f"ZeroDivisionError: division by zero ({here}:{div} in agent)": 2,
        "TimeoutError: the agent took more than 1 s between policy turns (step_timeout_s=1)": 2,
        silent[0]: 2}
    assert runner.counts["episodes_failed"] == 10 == sum(runner.failures.counts.values())
    err = capsys.readouterr().err
    assert err.count("an episode failed:") == 4 and "Traceback" not in err  # one line per distinct error
    written = log.read_text()
    assert written.count("=== rollout agent ") == 4 and written.count("Traceback (most recent call last)") == 3
    assert f'line {broke}, in agent\n    raise RuntimeError("agent broke")' in written


def test_the_run_summary_counts_failed_episodes_of_every_replica(tmp_path):
    log = tmp_path / "episode_failures.log"
    workers = {"rollout/0": {"episodes": 384, "episodes_failed": 3, "episode_errors": {"A: x (f.py:1 in a)": 3}},
               "rollout/1": {"episodes": 384, "episodes_failed": 5,
                             "episode_errors": {"A: x (f.py:1 in a)": 1, "B: y (f.py:2 in a)": 4}},
               "train/0": {"groups": 96}, "router": {"dispatched": 96}}
    assert episode_summary({"gen/0": {"groups": 4}}, log) == {}  # no rollout: no block
    block = episode_summary(workers, log)
    assert block == {"played": 768, "failed": 8, "errors": {"A: x (f.py:1 in a)": 4, "B: y (f.py:2 in a)": 4}}
    log.write_text("tracebacks")
    block = episode_summary(workers, log)
    assert block["log"] == str(log)
    text = format_summary({"wall_s": 1.0, "samples_trained": 10, "staleness_histogram": {}, "episodes": block})
    lines = text.splitlines()
    at = lines.index("episodes: 768 played, 8 failed (1.0%; left out of training):")
    assert lines[at + 1:at + 4] == ["       4 x A: x (f.py:1 in a)", "       4 x B: y (f.py:2 in a)",
                                    f"  first traceback of each: {log}"]


def test_a_failure_without_a_traceback_in_the_user_file_names_the_innermost_frame():
    failures = EpisodeFailures("env 'x'", object(), None)  # no source file
    try:
        json.loads("{")
    except ValueError as exc:
        line = failures.error(exc)
    assert line.startswith("JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 "
                           "(char 1) (") and " in raw_decode)" in line
