"""``support_desk``: a simulated customer-service desk with tools (multi-turn, tool calls).

A customer writes about one order; the agent (the policy) must resolve the hidden
intent with the right tool on the right order number:

======== ======================== ===============================================
intent   resolving call           first message
======== ======================== ===============================================
refund   ``refund(order)``        explicit ("refund order 4821 please") or vague
track    ``lookup(order)``        explicit ("where is order 4821") or vague
escalate ``escalate(order)``      explicit ("get me a manager, ...") or vague
======== ======================== ===============================================

A vague message ("problem with order 4821") is the same for all three
intents; the agent finds out by asking (a text turn with a question word gets the
customer's :data:`CLARIFY` reply) or by ``lookup(order)``, which resolves a ``track``
case and otherwise shows the status with the customer's complaint. ``refund`` /
``escalate`` on the right order and ``end()`` end the episode (resolved only when it is
the intent's call). A wrong order number, an unknown tool or a malformed call gets an
error observation and the episode goes on.

Rewards per turn: ``+1.0`` on the turn that resolves, ``0.0`` on a terminal turn that
does not, ``-turn_cost`` on every turn that does not end the episode (config
``turn_cost``, default :data:`TURN_COST` = 0.1; ``graphs/agent_support.yaml`` sets 0.3). So
with ``gamma = 0.9`` a 1-turn resolution returns 1.0 and a 2-turn one ``-0.1 + 0.9 = 0.8``
(``-0.3 + 0.9 = 0.6`` at 0.3).

Every text the env writes uses only the character tokenizer's alphabet (lowercase,
digits, ``+-*/=()., ``), so the tiny character model can read it.
"""

from __future__ import annotations

from areal_flow.envs.base import BaseEnv, EnvError, register_env, turn_cost
from areal_flow.envs.tools import ToolCall, ToolCallError, parse_tool_call
from areal_flow.models.presets import ALPHABET

INTENTS = ("refund", "track", "escalate")
RESOLVING_TOOL = {"refund": "refund", "track": "lookup", "escalate": "escalate"}
TURN_COST = 0.1
"""Reward of a turn that does not end the episode is ``-TURN_COST`` (config ``turn_cost``)."""

EXPLICIT = {
    "refund": ("refund order {o} please", "my order {o} is broken, refund it", "money back for order {o}"),
    "track": ("where is order {o}", "track order {o} please", "order {o} has not arrived"),
    "escalate": ("get me a manager, order {o}", "complaint about order {o}", "order {o}, i want your boss"),
}
"""First messages that reveal the intent, ``{o}`` = the order number (short: every
character is a token of the tiny model's context)."""
VAGUE = ("problem with order {o}", "help with order {o}", "order {o} is not ok", "order {o} went wrong")
"""First messages that are the same for every intent."""
CLARIFY = {"refund": "it is broken, refund it", "track": "it has not arrived", "escalate": "i want a manager"}
"""The customer's answer to a question (a text turn with a :data:`QUESTION_WORDS` word)."""
QUESTION_WORDS = frozenset({"what", "how", "help", "problem", "issue", "wrong", "why", "which"})
NOT_UNDERSTOOD = "sorry, what do you mean"
"""The customer's answer to any other text turn (no information)."""

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {"order": {"type": "integer", "description": "order number"}},
                       "required": ["order"]}}}
    for name, description in (("lookup", "show the status of an order (answers where it is)"),
                              ("refund", "refund an order to the customer"),
                              ("escalate", "hand the case to a manager"))
] + [{"type": "function", "function": {"name": "end", "description": "end the conversation",
                                        "parameters": {"type": "object", "properties": {}}}}]


def first_message(intent: str, order: int, explicit: bool, template: int) -> str:
    """The customer's opening message (``template`` is taken modulo the number of templates)."""
    options = EXPLICIT[intent] if explicit else VAGUE
    return options[template % len(options)].format(o=order)


def alphabet_safe(text: str, limit: int = 48) -> str:
    """``text`` lowercased, characters outside the tokenizer alphabet turned to spaces,
    runs of spaces collapsed, cut to ``limit`` characters."""
    kept = "".join(c if c in ALPHABET else " " for c in str(text).lower())
    return " ".join(kept.split())[:limit].strip()


@register_env("support_desk")
class SupportDeskEnv(BaseEnv):
    """One support conversation; deterministic given ``config``.

    Config (the dataset row, see ``areal_flow.tasks.support_desk``): ``intent`` (one of
    :data:`INTENTS`), ``order`` (int), ``prompt`` (the first message; built from
    ``explicit`` / ``template`` when absent); ``turn_cost`` (default :data:`TURN_COST`).

    ``step`` takes a ``ToolCall`` / ``ToolCallError`` (or a raw string, parsed here) and
    returns ``info = {"resolved": 0/1, "tool_error": 0/1}`` (``tool_error``: a malformed
    call, an unknown tool or an unknown order number; a plain text turn is not one).

    Raises:
        EnvError: ``intent`` missing / unknown, ``order`` missing / not an integer, or
            ``turn_cost`` not a number >= 0.
    """

    tools = TOOLS

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config)
        self.intent = self.config.get("intent")
        if self.intent not in INTENTS:
            raise EnvError(f"support_desk: config intent={self.intent!r}, expected one of {', '.join(INTENTS)}")
        try:
            self.order = int(self.config["order"])
        except (KeyError, TypeError, ValueError):
            raise EnvError(f"support_desk: config order={self.config.get('order')!r}, expected an integer") from None
        self.turn_cost = turn_cost("support_desk", self.config, TURN_COST)
        self.done = False

    def reset(self) -> str:
        self.done = False
        prompt = self.config.get("prompt")
        return prompt or first_message(self.intent, self.order, bool(self.config.get("explicit", True)),
                                       int(self.config.get("template", 0)))

    def step(self, action) -> tuple[str, float, bool, dict]:
        if self.done:
            raise EnvError("support_desk: step after the episode ended")
        if isinstance(action, str):
            action = parse_tool_call(action, self.tools)
        if isinstance(action, ToolCallError):
            if action.is_call_attempt:
                return self._go_on(f"error {alphabet_safe(action.reason, 42)}", tool_error=1)
            words = set(alphabet_safe(action.text, 200).replace(",", " ").replace(".", " ").split())
            return self._go_on(CLARIFY[self.intent] if words & QUESTION_WORDS else NOT_UNDERSTOOD)
        if not isinstance(action, ToolCall):
            raise EnvError(f"support_desk: step() takes a ToolCall, ToolCallError or str, got {type(action).__name__}")
        if action.name == "end":
            return self._end("bye", resolved=False)
        order = action.arguments.get("order")
        if order != self.order:
            return self._go_on(f"no order {alphabet_safe(order, 12)}", tool_error=1)
        if action.name == "lookup" and self.intent != "track":
            return self._go_on(f"delivered. {CLARIFY[self.intent]}")
        resolved = action.name == RESOLVING_TOOL[self.intent]
        if action.name == "lookup":
            return self._end(f"order {self.order} arrives in 2 days", resolved=resolved)
        return self._end("done, bye", resolved=resolved)

    def _go_on(self, observation: str, tool_error: int = 0) -> tuple[str, float, bool, dict]:
        return observation, -self.turn_cost, False, {"resolved": 0, "tool_error": tool_error}

    def _end(self, observation: str, resolved: bool) -> tuple[str, float, bool, dict]:
        self.done = True
        return observation, 1.0 if resolved else 0.0, True, {"resolved": int(resolved), "tool_error": 0}
