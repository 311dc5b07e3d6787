"""The envs shipped with areal-flow; importing this module registers them (and does nothing else)."""

from areal_flow.envs import guess_number, support_desk  # noqa: F401  (@register_env on import)
