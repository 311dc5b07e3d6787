"""Environments for multi-turn rollouts: ``BaseEnv``, ``register_env``, tool calls."""

from areal_flow.envs.agent import set_reward
from areal_flow.envs.base import BaseEnv, EnvError, register_env
from areal_flow.envs.builtin import env_class, make_env

__all__ = ["BaseEnv", "EnvError", "env_class", "make_env", "register_env", "set_reward"]
