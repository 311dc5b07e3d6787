"""The episode loop: multi-turn episodes (envs or agent programs) on a generation engine.

Owns the episode loop of ``areal_flow.ops.rollout``: every episode runs as ordinary
blocking code in its own thread (``env.reset``, then per turn: ask the engine for the
policy's turn, parse it, ``env.step``), while the replica's thread owns the engine:
``step`` submits the turns the episodes asked for, runs one engine step and hands the
finished turns back. Each episode's env (or agent) gets its own deep copy of the node's
``env_config`` with the dataset row over it, so episodes share no state and the dataset
and the node are never changed. So many env instances run at once, a slow env stalls only its
episode, and weight updates (``update_weights``, between engine steps) land between
turns or inside one; each token keeps the version that sampled it.

An agent program (``attrs["agent"]``, ``agent(base_url, row) -> reward | None``) instead
of an env runs in the episode's thread against this runner's OpenAI-compatible endpoint
(``runtime.executors.agent_endpoint``, one loopback server per runner, started with the
first agent episode, stopped by :meth:`EpisodeRunner.close`): each chat completion call is
one policy turn, the agent's own time between calls is the env phase, and its return
value (when not ``None``) is added to the last turn's reward.

An episode whose env (or agent) raises (a programming error aside: ``TypeError``,
``AttributeError``, ... stop the run, ``runtime.executors.bugs``), or whose ``reset``/``step`` (the agent's time
between policy turns) takes more than ``step_timeout_s``, ends as failed: it is left
out of its group (its group's statistics are over the others; a group with no surviving
episode is dropped and its slot resampled) and counted per distinct error
(``runtime.executors.episode_failures``: the first of each prints one line, its traceback
goes to the run folder's ``episode_failures.log``, the run summary counts them). Failed
episodes are budgeted as failed rewards are (``areal_flow.rewards.pool.FailureMonitor``, node
attributes ``max_failure_fraction`` / ``failure_window`` lowered from ``reward.*``): when more
than that fraction of the last window's episodes failed, the run stops with one line naming
the node, the env (agent) and the count, instead of resampling forever. A hung
env (agent) thread cannot be killed; it is abandoned (a daemon thread) and its late
result ignored. A policy turn the engine refuses (``RequestRefused``) fails its episode the
same way.

An episode with no policy token (its first observation fills ``max_context``) would shift
its group's baseline with nothing to train: as an empty ``ops.generate`` response, it is left
out of its group, counted (``empty_episodes``) and recorded on the failure budget.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal_flow.envs.builtin import env_class
from areal_flow.envs.episode import Episode
from areal_flow.envs.tools import ToolCallError, parse_tool_call
from areal_flow.rewards.pool import FailureMonitor, Outcome
from areal_flow.types import Trajectory
from areal_flow.values import Prompt, Rollouts
from runtime.engines.generation import GenerationRequest, RequestRefused, SamplingParams
from runtime.executors.bugs import PROGRAMMING_ERRORS, ProgrammingError, programming_error
from runtime.executors.episode_failures import EpisodeFailures

NO_POLICY_TOKEN = "an episode with no policy token (its first observation fills max_context)"
"""The failure kind of an episode left out for holding no policy token (module doc)."""
_IDLE_WAIT_S = 0.005  # how long step() waits for a turn request when only envs are busy


class _Abandoned(Exception):
    """The episode was ended (timed out) while its thread was away."""


@dataclass
class _Run:
    """One episode in flight."""

    index: int
    attempt: int
    sample: int
    row: dict
    episode: Episode
    phase: str = "env"  # env (reset/step or the agent's own code) | policy (waiting for its turn)
    since: float = field(default_factory=time.monotonic)
    failed: str = ""
    error: str = ""  # the failure's summary line (EpisodeFailures)
    tool_errors: int = 0
    info: dict = field(default_factory=dict)
    done: bool = False


class EpisodeRunner:
    """Plays episodes of env ``attrs["env"]`` (or agent program ``attrs["agent"]``) on
    ``engine`` (module doc).

    Args:
        engine: an engine with ``submit``/``step``/``has_work``/``update_weights``/``version``.
        tokenizer: the policy's tokenizer.
        attrs: the rollout node's attributes (``env`` or ``agent``, ``env_config``,
            ``max_turns``, ``gamma``, ``n_samples``, ``chat_template``, ``step_timeout_s``,
            ``max_failure_fraction`` (default 0.5) and ``failure_window`` (episodes, default 200)).
        params: sampling settings of every policy turn.
        max_context: tokens of prompt + turns at most.
        failure_log: where the first traceback of each distinct episode error goes
            (``EpisodeFailures``; None: nowhere).
        name: the rollout node's name (in the failure budget's message).

    Raises:
        EnvError: no ``attrs["agent"]`` and ``attrs["env"]`` names no registered env.
        ValueError: a failure budget outside ``0 < max_failure_fraction <= 1``, ``failure_window >= 1``.
    """

    def __init__(self, engine, tokenizer, attrs: dict, params: SamplingParams, max_context: int,
                 failure_log: Path | None = None, name: str = "rollout") -> None:
        self.engine, self.tokenizer, self.attrs, self.params = engine, tokenizer, attrs, params
        self.agent = attrs.get("agent")
        self.env_cls = None if self.agent is not None else attrs.get("env_class") or env_class(attrs["env"])
        chat = attrs.get("chat_template")
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else bool(chat)
        self.max_context = max_context
        self._requests: queue.Queue = queue.Queue()
        self._waiting: dict[str, tuple[_Run, list]] = {}
        self._groups: dict[tuple[int, int], list[_Run]] = {}
        self._serial = 0
        self.counts = {"episodes": 0, "episodes_failed": 0, "env_timeouts": 0, "tool_call_errors": 0,
                       "empty_episodes": 0}
        who = f"agent {_name(self.agent)}" if self.agent is not None else f"env '{attrs['env']}'"
        self.failures = EpisodeFailures(who, self.agent if self.agent is not None else self.env_cls, failure_log)
        self.monitor = FailureMonitor(f"rollout node '{name}' ({who})", attrs.get("max_failure_fraction", 0.5),
                                      attrs.get("failure_window", 200))
        self._endpoint = None  # the agent endpoint, started with the first agent episode
        self.where = who  # names the runner in a ProgrammingError (RolloutExecutor: the node too)
        self._bug: ProgrammingError | None = None  # set by an episode thread, raised by step()
        self._endpoint_lock = threading.Lock()

    # -- the episode side (one thread per episode) ------------------------------------
    def _env_call(self, run: _Run, fn):
        run.phase, run.since = "env", time.monotonic()
        out = fn()
        if run.failed:
            raise _Abandoned
        return out

    def _policy_turn(self, run: _Run, ids: list[int], max_new_tokens: int | None = None):
        """The engine's answer to context ``ids`` (blocks; ``max_new_tokens`` may only lower
        the node's budget). Raises _Abandoned when the episode failed meanwhile."""
        run.phase = "policy"
        box: list = []
        ready = threading.Event()
        self._requests.put((run, ids, box, ready, max_new_tokens))
        ready.wait()
        if run.failed:
            raise _Abandoned
        return box[0]

    def _episode_config(self, run: _Run) -> dict:
        """The episode's own config: a deep copy of the node's ``env_config`` with a deep copy
        of the dataset row over it, so nothing an env (agent) changes in it reaches another
        episode, the dataset or the node. Raises what ``copy.deepcopy`` raises for a value
        that cannot be copied (the episode fails, naming it)."""
        return copy.deepcopy({**(self.attrs.get("env_config") or {}), **run.row})

    def _play(self, run: _Run) -> None:
        env = None
        a = self.attrs
        try:
            env = self._env_call(run, lambda: self.env_cls(self._episode_config(run)))
            run.episode.tools = env.tools
            run.episode.observe(_checked(env, self._env_call(run, env.reset)))
            for turn in range(a["max_turns"]):
                ids = run.episode.context_ids
                if len(ids) >= self.max_context - 1:
                    run.episode.finish_reason = "length"
                    break
                result = self._policy_turn(run, ids)
                text = result.output_text.strip()
                run.episode.act(result.output_ids, result.behavior_logprobs, result.versions, text,
                                result.finish_reason)
                action = parse_tool_call(text, env.tools) if env.tools else text
                if isinstance(action, ToolCallError) and action.is_call_attempt:  # plain text is no error
                    run.tool_errors += 1
                obs, reward, done, info = self._env_call(run, lambda: env.step(action))
                run.episode.reward(float(reward))
                for key, value in (info or {}).items():
                    if isinstance(value, (int, float)):
                        run.info[key] = run.info.get(key, 0.0) + float(value)
                if done or turn + 1 == a["max_turns"]:
                    break
                run.episode.observe(_checked(env, obs))
        except _Abandoned:
            return
        except PROGRAMMING_ERRORS as exc:  # a bug in the env or ours: the run stops (runtime.executors.bugs)
            self._stop(run, exc)
        except Exception as exc:  # the env failed on this episode's data, I/O or time: this episode only
            run.error = self.failures.error(exc)  # before failed: the engine's thread may end the group at once
            run.failed = f"{type(exc).__name__}: {exc}"
        finally:
            if env is not None:
                try:
                    env.close()
                except Exception:  # closing a failed env must not hide its failure
                    pass
            run.done = True

    def _play_agent(self, run: _Run) -> None:
        """One episode of the agent program: ``agent(base_url, row)`` in this thread (``row``:
        the dataset row over ``env_config``); its chat calls are the policy turns
        (``agent_endpoint``); time-outs and failures as ``_play``."""
        endpoint, key = None, ""
        try:
            endpoint = self._agent_endpoint()
            key, url = endpoint.open(run)
            run.phase, run.since = "env", time.monotonic()
            value = self.agent(url, self._episode_config(run))
            if run.failed:
                raise _Abandoned
            endpoint.end(key)  # no call of this episode is in flight any more
            if not run.episode.n_turns:
                raise RuntimeError(f"agent {_name(self.agent)} returned without a chat completion call: an episode "
                                   "needs at least one policy turn")
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"agent {_name(self.agent)} returned {value!r:.80}: a reward (float) or None")
                run.episode.reward(float(value))
        except _Abandoned:
            return
        except PROGRAMMING_ERRORS as exc:  # a bug in the agent or ours: the run stops (runtime.executors.bugs)
            self._stop(run, exc)
        except Exception as exc:  # the agent failed (or timed out and then failed): this episode only
            if not run.failed:
                run.error = self.failures.error(exc)  # before failed, as in _play
                run.failed = f"{type(exc).__name__}: {exc}"
        finally:
            if endpoint is not None and key:
                endpoint.end(key)
            run.done = True

    def _stop(self, run: _Run, exc: BaseException) -> None:
        """Episode thread: a programming error ends ``run`` and makes the next :meth:`step` raise it."""
        if self._bug is None:
            self._bug = programming_error(self.where, exc)
        run.failed = run.failed or f"{type(exc).__name__}: {exc}"

    def _agent_endpoint(self):
        with self._endpoint_lock:
            if self._endpoint is None:
                from runtime.executors.agent_endpoint import AgentEndpoint

                model = getattr(getattr(self, "node", None), "model", None) or "policy"
                self._endpoint = AgentEndpoint(self, model=str(model))
            return self._endpoint

    def report(self) -> dict:
        """Its counters and the failed episodes by kind (``episode_errors``) for the replica's report."""
        return {**self.counts, "episode_errors": dict(self.failures.counts)}

    def close(self) -> None:
        """Stop the agent endpoint, if one started (idempotent)."""
        with self._endpoint_lock:
            endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.close()

    # -- the engine side (the replica's thread) --------------------------------------
    def submit(self, index: int, attempt: int, problem: Prompt) -> None:
        """Start the ``n_samples`` episodes of dataset row ``problem``, the ``attempt``-th row of
        prompt group ``index``."""
        runs = []
        for j in range(self.attrs["n_samples"]):
            run = _Run(index, attempt, j, dict(problem), Episode(self.tokenizer, self.chat))
            play = self._play if self.agent is None else self._play_agent
            threading.Thread(target=play, args=(run,), daemon=True, name=f"episode-{index}:{j}").start()
            runs.append(run)
        self._groups[(index, attempt)] = runs

    def has_work(self) -> bool:
        return bool(self._groups)

    def _submit_turns(self, block_s: float) -> None:
        try:
            item = self._requests.get(timeout=block_s) if block_s > 0 else self._requests.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            run, ids, box, ready, budget = item
            self._serial += 1
            rid = f"{run.index}:{run.sample}/{run.attempt}#{self._serial}"
            budget = min(self.params.max_new_tokens, budget or self.params.max_new_tokens, self.max_context - len(ids))
            params = SamplingParams(temperature=self.params.temperature, top_p=self.params.top_p,
                                    max_new_tokens=max(1, budget))
            self._waiting[rid] = (run, box, ready)
            try:
                self.engine.submit(GenerationRequest(rid, list(ids), params))
            except PROGRAMMING_ERRORS as exc:  # runtime.executors.bugs
                raise programming_error(self.where, exc) from exc
            except RequestRefused as exc:  # this episode fails; any other engine fault stops the replica
                del self._waiting[rid]
                run.error = self.failures.error(exc)
                run.failed = f"{type(exc).__name__}: {exc}"
                ready.set()
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                item = None

    def step(self) -> list[tuple[int, int, Rollouts]]:
        """Submit the turns asked for, one engine step, time-outs; the groups all of whose
        episodes ended: ``(index, attempt, rollouts)``, the surviving trajectories.

        Raises:
            FailureFractionError: the failure budget is used up (module doc).
            ProgrammingError: an episode's env or agent, or the engine, raised a programming
                error (``runtime.executors.bugs``): the run stops.
        """
        self._submit_turns(0 if self.engine.has_work() else _IDLE_WAIT_S)
        if self.engine.has_work():
            for result in self.engine.step():
                run, box, ready = self._waiting.pop(result.request_id)
                box.append(result)
                ready.set()
        now, limit = time.monotonic(), float(self.attrs.get("step_timeout_s", 30.0))
        done = []
        for key, runs in list(self._groups.items()):
            for run in runs:
                if not (run.done or run.failed) and run.phase == "env" and now - run.since > limit:
                    run.failed = (f"TimeoutError: env step took more than {limit:g} s" if self.agent is None else
                                  f"TimeoutError: the agent took more than {limit:g} s between policy turns")
                    self.counts["env_timeouts"] += 1
                    run.error = self.failures.timeout(f"{run.failed} (step_timeout_s={limit:g})")
            if all(run.done or run.failed for run in runs):
                del self._groups[key]
                done.append((*key, Rollouts(self._finish(runs))))
        if self._bug is not None:
            raise self._bug
        return done

    def _finish(self, runs: list[_Run]) -> list[Trajectory]:
        """The group's trajectories: its failed episodes and those with no policy token left
        out (module doc), each recorded on the failure budget."""
        failed = sum(bool(r.failed) for r in runs)
        self.counts["episodes"] += len(runs)
        self.counts["episodes_failed"] += failed
        out = []
        for run in runs:
            empty = not run.failed and not any(run.episode.loss_mask)
            line = run.error or run.failed or (NO_POLICY_TOKEN if empty else "")
            self.monitor.record(Outcome(kind=line, detail=line), f"{run.index}:{run.sample}")
            if run.failed:
                self.failures.count(line)
                continue
            if empty:
                self.counts["empty_episodes"] += 1
                continue
            self.counts["tool_call_errors"] += run.tool_errors
            ep = run.episode
            meta = {"answer": run.row.get("answer"), "problem_id": run.row.get("id"), "attempt": run.attempt,
                    "turns": ep.n_turns, "tool_errors": run.tool_errors, "env": dict(run.info),
                    "group_failed": failed}
            traj = ep.to_trajectory(f"{run.index}:{run.sample}", run.index, self.attrs["gamma"], meta)
            traj.correct = episode_correct(run.info, traj.reward, self.agent is not None)
            out.append(traj)
        return out

    @property
    def version(self) -> int:
        return self.engine.version

    def occupancy(self) -> dict:
        """Nothing: an engine step's turns are not counted here (``GenerateExecutor.occupancy`` is)."""
        return {}

    def update_weights(self, state_dict, version: int) -> None:
        """Pause, load ``version``, resume: in-flight turns continue under the new weights."""
        self.engine.update_weights(state_dict, version)


def episode_correct(info: dict, episode_return: float, agent: bool) -> bool | None:
    """An episode's ``Trajectory.correct``: an agent program's return > 0; else the env's
    ``success`` (or ``resolved``) info, summed over its steps, > 0; None when the env reports
    neither (its episodes are not judged)."""
    if agent:
        return episode_return > 0
    value = info.get("success", info.get("resolved"))
    return None if value is None else value > 0


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _checked(env, obs):
    """``obs`` when it fits ``env.observation_space`` (``"text"``: a str; ``"messages"``: a chat
    message dict or a list of them). Raises TypeError naming the env."""
    space = getattr(env, "observation_space", "text")
    ok = isinstance(obs, str) if space == "text" else (
        isinstance(obs, dict) or (isinstance(obs, list) and all(isinstance(m, dict) for m in obs)))
    if not ok:
        raise TypeError(f"{type(env).__name__}: observation {obs!r:.80} does not fit observation_space={space!r}")
    return obs
