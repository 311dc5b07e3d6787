"""``verifiers`` environments (prime-rl's format) as rollout envs: ``env="verifiers:<id>"``.

``ops.rollout(policy, prompts, env="verifiers:<env id or module>", env_config={...})``
plays the environment's own rollouts through the generation engine: ``ops.rollout``
turns the name into a :class:`VerifiersProgram`, an agent program (``agent(base_url, row)``)
that loads the environment with ``verifiers.load_environment(<id>, **env_config)`` (the
module ``<id>`` with ``-`` as ``_``, as prime-rl loads an installed environment; a dotted
module path works too) and, for each episode, runs the environment's ``run_rollout`` with a
``vf.OpenAIChatCompletionsClient`` on the episode's base URL of the generation worker's
OpenAI-compatible endpoint (``runtime.executors.agent_endpoint``). So the environment's
own loop decides the turns (``SingleTurnEnv``, ``MultiTurnEnv.env_response``, a
``ToolEnv``'s tool calls, its stop conditions), each of its model calls is one policy
turn recorded with the exact sampled ids, log-probs and versions, every message it adds is
a masked observation, and its rubric's score (``state["reward"]``, the weighted sum of its
reward functions) is the episode's reward, on the last turn.

The episode's input is built from the dataset row (:func:`rollout_input`): chat messages
(``messages``, as ``dataset.name: verifiers:<env id>`` rows carry the environment's own
prompts, ``areal_flow.tasks.verifiers_data``; or a ``prompt`` that is a list) are used as
they are;
a text becomes one user message, after the environment's ``system_prompt`` and
``few_shot`` messages when it has them (as verifiers formats its dataset's
``question``); ``answer``, ``info`` and ``id`` (as ``example_id``) pass through.

Limits, each refused with a clear error: a rubric with group reward functions (each
episode is scored alone: its group's episodes run in separate threads); a rollout that
ends in an error (``state["error"]``: a refused call, a raising tool or env) fails its
episode, except the policy's own outcomes (:data:`POLICY_OUTCOMES`): a rollout cut by the
rollout's ``max_turns`` or ``max_context`` (the endpoint refuses the call) or ended by an
empty reply is scored as it is, as verifiers scores a truncated rollout.
Keep the rollout's ``max_turns`` at least the environment's.

``verifiers`` is an optional dependency (the ``envs`` extra), imported when an episode
runs; :func:`check_spec` (trace time) needs only the module to be findable.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import signal
import threading

PREFIX = "verifiers:"
EXTRA_HINT = "pip install 'areal-flow[envs]' (verifiers==0.3.1)"
POLICY_OUTCOMES = ("max_turns reached", "EmptyModelResponseError")
"""Rollout errors that are the policy's doing, scored by the rubric rather than failing the
episode (verifiers keeps only the name and message of the error it records): the endpoint's
refusal of a call past the rollout's ``max_turns`` (a cut), and an empty reply (the policy
sampled EOS at once; verifiers aborts on it). A call past ``max_context`` verifiers itself
turns into a truncated rollout (``prompt_too_long``)."""

_LOADED: dict[tuple, object] = {}  # (env id, env args) -> environment, one per process
_LOAD_LOCK = threading.Lock()


def is_verifiers(env) -> bool:
    """Whether an ``env=`` value names a verifiers environment (``"verifiers:<id>"``)."""
    return isinstance(env, str) and env.startswith(PREFIX)


def _vf():
    try:
        import verifiers
    except ImportError as exc:
        raise ImportError(f"verifiers environments need the verifiers package: {EXTRA_HINT}") from exc
    return verifiers


def module_name(env_id: str) -> str:
    """The module verifiers imports for ``env_id`` (``-`` as ``_``, the last ``/`` part)."""
    return env_id.replace("-", "_").split("/")[-1]


def check_spec(env: str) -> str:
    """The env id of ``env`` (``"verifiers:<id>"``), checked without importing it.

    Raises:
        ValueError: no id after the prefix, verifiers not installed (naming the extra), or
            no importable module for the id.
    """
    env_id = env[len(PREFIX):].strip()
    if not env_id:
        raise ValueError(f"env={env!r}: name the environment, verifiers:<env id or module>")
    _vf()
    try:
        found = importlib.util.find_spec(module_name(env_id)) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"env={env!r}: no module {module_name(env_id)!r} to import; install the environment "
                         f"(its package provides load_environment) or name a module on the Python path")
    return env_id


def load(env_id: str, env_args: dict):
    """The environment ``verifiers.load_environment(env_id, **env_args)``, loaded once per process.

    Raises:
        ValueError: its rubric has group reward functions (module doc).
        whatever ``load_environment`` raises (a bad argument, a missing module).
    """
    key = (env_id, repr(sorted(env_args.items())))
    with _LOAD_LOCK:
        if key not in _LOADED:
            vf = _vf()
            with _signal_handlers_kept():
                environment = vf.load_environment(env_id, **env_args)
            if environment.requires_group_rollouts:
                raise ValueError(f"verifiers env {env_id!r}: its rubric has group reward functions; areal-flow "
                                 "scores each episode alone (use per-rollout reward functions)")
            _LOADED[key] = environment
        return _LOADED[key]


class _KeepHandlers:
    """Stands in for the ``signal`` module inside verifiers' environment module while an
    environment is built: ``signal.signal`` does nothing, the rest is the real module's."""

    def __getattr__(self, name):
        return getattr(signal, name)

    @staticmethod
    def signal(signum, handler):
        return signal.getsignal(signum)


@contextlib.contextmanager
def _signal_handlers_kept():
    """While it is open, verifiers' ``Environment.__init__`` installs no SIGINT/SIGTERM
    handler: it calls ``signal.signal`` for both (to tear the environment down), which
    raises ValueError outside the main thread (episodes run in their own threads) and would
    take the generation worker's own handlers. Its ``atexit`` teardown stays."""
    try:
        module = importlib.import_module("verifiers.legacy.envs.environment")
    except ImportError:  # another layout of verifiers: nothing to keep
        module = None
    if getattr(module, "signal", None) is not signal:
        yield
        return
    module.signal = _KeepHandlers()
    try:
        yield
    finally:
        module.signal = signal


def rollout_input(environment, row: dict) -> dict:
    """The verifiers ``RolloutInput`` of a dataset row (module doc)."""
    prompt = row.get("messages", row.get("prompt"))
    if not isinstance(prompt, list):
        messages = [{"role": "system", "content": environment.system_prompt}] if environment.system_prompt else []
        prompt = messages + list(environment.few_shot or []) + [{"role": "user", "content": str(prompt or "")}]
    out = {"prompt": prompt, "example_id": row.get("example_id", row.get("id", 0))}
    if row.get("answer") is not None:
        out["answer"] = str(row["answer"])
    if row.get("info") is not None:
        out["info"] = row["info"]
    return out


class VerifiersProgram:
    """The agent program of ``env="verifiers:<env id>"``: ``program(base_url, row) -> reward``.

    Args:
        env_id: the environment's id or module.
        env_args: keyword arguments of its ``load_environment`` (the rollout's ``env_config``).
        model: the model name the client sends (the endpoint does not check it).
    """

    def __init__(self, env_id: str, env_args: dict | None = None, model: str = "policy") -> None:
        self.env_id, self.env_args, self.model = env_id, dict(env_args or {}), model
        self.__qualname__ = f"{PREFIX}{env_id}"  # how failures and summaries name the agent

    def __repr__(self) -> str:
        return f"VerifiersProgram({self.env_id!r}, {self.env_args!r})"

    def __call__(self, base_url: str, row: dict) -> float:
        """One episode: the environment's rollout against ``base_url``, scored by its rubric.

        Raises:
            RuntimeError: the rollout ended in an error other than a truncation (named).
        """
        environment = load(self.env_id, self.env_args)
        return asyncio.run(self._play(environment, base_url, rollout_input(environment, row)))

    async def _play(self, environment, base_url: str, rollout: dict) -> float:
        vf = _vf()
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as openai_client:
            client = vf.OpenAIChatCompletionsClient(openai_client)
            output = await environment.run_rollout(rollout, client, self.model, dict(environment.sampling_args))
        error = output.get("error")
        if error and not any(outcome in str(error) for outcome in POLICY_OUTCOMES):
            raise RuntimeError(f"verifiers env {self.env_id!r}: the rollout ended in an error: {str(error):.300}")
        return float(output["reward"])
