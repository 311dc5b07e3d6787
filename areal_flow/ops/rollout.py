"""``ops.rollout``: multi-turn episodes of a policy against an environment.

Port schema: as ``ops.generate`` (input ``prompts``, optional ``weights``; output
``rollouts``), so reward, filter, advantage and train_step nodes take its episodes like
any generated group, bounded staleness included. Grain ``stream``: the runtime runs the
episode loop (``runtime.executors.episode_runner``) on a generation replica: the policy's turn
on the generation engine, then ``env.step`` (``areal_flow.envs``), until the env says done,
``max_turns`` policy turns, or ``max_context`` tokens. Each episode is one
:class:`~areal_flow.types.Trajectory` whose observation tokens are masked out of the loss
(``loss_mask``), whose policy tokens keep the version that sampled them, and whose
``turn_rewards`` the env gave; its ``reward`` is the discounted return
``G_0 = sum_k gamma^k R_k`` (Sutton & Barto 2018, eq. 3.8, one step per turn), so GRPO or
RLOO baselines compare whole episodes of a group. ``estimator="multi_turn"`` in
``ops.advantage`` credits each turn with its own return ``G_k`` instead.
"""

from __future__ import annotations

from areal_flow.tracing import Handle, Model, outputs, record
from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.ops.generate import check_sampling
from areal_flow.ops.registry import GENERATION, STREAM, OpDef, define, op_function

SPEC = OpSpec(
    "rollout",
    inputs=(PortSpec("prompts", "prompts"), PortSpec("weights", "weights", required=False)),
    outputs=(PortSpec("rollouts", "rollouts"),),
    needs_model=True,
)
OP = define(OpDef(SPEC, STREAM, GENERATION, "runtime.executors.rollout:RolloutExecutor", multi_turn=True))


@op_function
def rollout(
    policy: Model,
    prompts: Handle,
    *,
    env: str | None = None,
    agent=None,
    max_turns: int = 8,
    gamma: float = 1.0,
    n_samples: int = 1,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    chat_template: bool | None = None,
    engine: str = "embedded",
    max_context: int | None = None,
    step_timeout_s: float = 30.0,
    env_config: dict | None = None,
    name: str | None = None,
) -> Handle:
    """Declare multi-turn rollouts against env ``env``.

    Args:
        policy: the model that acts (the behavior policy at its current version).
        prompts: a ``prompts`` handle (``ops.dataset``): one row per episode group; the row
            (``id``, ``prompt``, task fields) and ``env_config`` make the env's ``config``.
        env: a name registered with ``areal_flow.envs.register_env``, or
            ``"verifiers:<env id or module>"``: a ``verifiers`` environment (prime-rl's format),
            loaded with ``env_config`` as its ``load_environment`` arguments, whose own
            rollouts are played and whose rubric is the reward
            (``areal_flow.envs.verifiers_env``).
        agent: instead of ``env``, an agent program ``agent(base_url, row) -> reward | None``
            written against the OpenAI API: it talks to the policy through the generation
            worker's OpenAI-compatible endpoint at ``base_url`` (``/v1/chat/completions``);
            its calls of one episode become one multi-turn trajectory
            (``runtime.executors.agent_endpoint``); its return value (or
            ``areal_flow.envs.set_reward``) is the reward.
        max_turns: policy turns per episode at most.
        gamma: discount per turn of the episode return.
        n_samples: episodes per row (the group of GRPO/RLOO).
        max_new_tokens: tokens per policy turn at most.
        temperature / top_p / chat_template / engine: as in ``ops.generate``.
        max_context: tokens of prompt + all turns at most (default: the model's context).
        step_timeout_s: seconds an ``env.reset``/``env.step`` (an agent: its own time
            between two replies) may take; past it the episode ends as failed (excluded
            from its group, counted), the run goes on.
        env_config: extra keys merged into every episode's env ``config``.

    Raises:
        GraphError: naming the node and line, when an argument is out of range or ``env``
            names no registered env.
    """
    node = record(
        SPEC,
        {"prompts": prompts},
        model=policy,
        attrs=dict(env=env, agent=agent, max_turns=max_turns, gamma=gamma, n_samples=n_samples, max_new_tokens=max_new_tokens,
                   temperature=temperature, top_p=top_p, chat_template=chat_template, engine=engine,
                   max_context=max_context, step_timeout_s=step_timeout_s, env_config=dict(env_config or {})),
        name=name,
    )
    check_sampling(node)
    _attach_env(node, env, agent)
    for bad, rule in (((env is None) == (agent is None), "pass exactly one of env= (a registered env name) and "
                       "agent= (an OpenAI-client agent program)"),
                      (env is not None and (not isinstance(env, str) or not env),
                       f"env={env!r}: the name of a registered env"),
                      (agent is not None and not callable(agent), f"agent={agent!r}: must be callable"),
                      (max_turns < 1, f"max_turns={max_turns}: must be >= 1"),
                      (not 0.0 <= gamma <= 1.0, f"gamma={gamma}: must be in [0, 1]"),
                      (step_timeout_s <= 0, f"step_timeout_s={step_timeout_s}: must be > 0"),
                      (max_context is not None and max_context < 2, f"max_context={max_context}: must be >= 2")):
        if bad:
            raise GraphError(f"{node.where()}: {rule}")
    return outputs(node, SPEC)


def _attach_env(node, env, agent) -> None:
    """Check ``env`` names a registered env; an env registered outside areal-flow (in the graph
    file) travels with the plan by value (``env_class`` attribute), as user ops do. A
    verifiers environment becomes the node's agent program (``verifiers_env.VerifiersProgram``)."""
    from areal_flow.envs import verifiers_env
    from areal_flow.envs.base import EnvError
    from areal_flow.envs.builtin import env_class

    if not isinstance(env, str):
        return
    if verifiers_env.is_verifiers(env):
        if agent is None:  # both given: refused below
            try:
                env_id = verifiers_env.check_spec(env)
            except (ValueError, ImportError) as exc:
                raise GraphError(f"{node.where()}: {exc}") from None
            node.attrs["agent"] = verifiers_env.VerifiersProgram(env_id, node.attrs["env_config"])
        return
    try:
        cls = env_class(env)
    except EnvError as exc:
        raise GraphError(f"{node.where()}: {exc}") from None
    if not cls.__module__.startswith("areal_flow."):
        node.attrs["env_class"] = cls
