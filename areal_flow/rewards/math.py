"""Rule reward for math word problems (GSM8K conventions).

Owns: pulling the final answer out of a model's free text, normalizing it to an exact
rational number, and comparing it with the reference answer. LaTeX that is more than a
plain number (``\\frac{1}{2}``, ``1\\frac{1}{2}``, ``2\\sqrt{2}``) is parsed and compared
with Hugging Face's ``math-verify`` (``math_verify.parse`` / ``math_verify.verify``);
everything GSM8K-specific (``#### 42``, "The answer is 42.", thousands commas, currency,
trailing units, percent) is our own code. Must not: tokenize, batch, or know about
trajectories (the ``reward`` op does that).

Answer extraction, first rule that finds something wins:

1. the last ``#### <answer>`` (GSM8K's reference format);
2. the last ``\\boxed{...}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}`` works);
3. the last "answer is / answer: / answer =" phrase (of the last 8) with a number after it
   on its line (within 200 characters): that first number;
4. the last number anywhere in the text.

Numbers are compared exactly as ``fractions.Fraction`` (``3.50 == 3.5``, ``1/2 == 0.5``,
``10**20 + 1 != 10**20``), never through floats.
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

import sympy
from math_verify import parse as _mv_parse
from math_verify import verify as _mv_verify
from math_verify.errors import TimeoutException as _MathVerifyTimeout

# A signed decimal number with optional thousands commas and an optional "/denominator".
# The sign only counts when it does not follow a word character or ")" ("8-5" is 8 and 5,
# "x = -5" is -5); it may stand before or after a currency sign ("-$5", "$-5"). Unicode
# minus (U+2212) is accepted.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)])(?P<sign>[-\u2212+])\s?)?"
    r"(?:(?P<currency>[$\u20ac\u00a3\u00a5])\s?(?P<sign2>[-\u2212])?)?"
    r"(?<![\d.])(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+|(?=\.\d))"
    r"(?P<frac>\.\d+)?"
    r"(?:/(?P<den>\d+(?:\.\d+)?))?"
)
_HASH_RE = re.compile(r"####[ \t]*(?P<span>[^\n]*)")
_ANSWER_RE = re.compile(r"\banswer\b\s*(?:is|was|would be|will be|should be)?\s*[:=]?", re.IGNORECASE)
# LaTeX that only decorates a number: \text{ dollars}, \$, \%, {,}, thin spaces, \left/\right.
_LATEX_DECOR_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{[^{}]*\}|\\[$%,!;: ]|\\(?:left|right)")
# LaTeX that only math-verify understands.
_LATEX_MATH_RE = re.compile(r"\\(?:d|t)?frac|\\sqrt|\\pi|\^")
_MAX_TEXT_CHARS = 100_000  # longer outputs are judged on their last 100k characters
_MATH_VERIFY_MAX_CHARS = 2_000
_ANSWER_SPAN_CHARS = 200  # an answer phrase's value is looked for this far, within its line
_MAX_ANSWER_PHRASES = 8  # only the last 8 answer phrases are tried (bounds the work)
_MESSAGE_CHARS = 60  # a MathVerifyError names this much of the reference and of the output's end


def math_reward(output_text: Any, reference: str | int | float | Fraction) -> float:
    """1.0 if the final answer in ``output_text`` equals ``reference``, else 0.0.

    Args:
        output_text: the model's decoded response. Anything that is not a ``str`` (None,
            bytes, numbers) and any text without an answer scores 0.0; the output never
            makes this function raise, except through math-verify (MathVerifyError).
        reference: the reference answer, e.g. ``"72"``, ``"1,200"``, ``"-3"``, ``"0.5"``,
            ``"\\frac{1}{2}"``, or a number.

    Returns:
        1.0 or 0.0 (float). Comparison is exact on rationals after normalization
        (commas in thousands, sign, decimals, ``a/b``, currency, trailing units, ``%``
        dropped) or, for LaTeX expressions, ``math_verify.verify``.

    Raises:
        ValueError: ``reference`` is neither a number (as ``parse_number`` reads it) nor
            LaTeX math (``\\frac``, ``\\sqrt``, ``^``, ``\\pi``) that math-verify parses;
            that is a data bug, not a model error.
        MathVerifyError: math-verify raised or timed out parsing the reference or the
            output's LaTeX, or comparing the two (the reward is unknown: a failed sample,
            not a 0). The message names the reference and the output's last characters.
    """
    try:
        gold = _parse_reference(reference)
        if not isinstance(output_text, str) or not output_text.strip():
            return 0.0
        try:
            predicted = extract_answer(output_text)
        except (ValueError, ZeroDivisionError, RecursionError):  # our own extraction on garbage text
            return 0.0
        if predicted is None:
            return 0.0
        if isinstance(predicted, Fraction) and isinstance(gold, Fraction):
            return 1.0 if predicted == gold else 0.0
        return 1.0 if _verify(_to_sympy(gold), _to_sympy(predicted)) else 0.0
    except MathVerifyError as exc:
        tail = output_text[-_MESSAGE_CHARS:] if isinstance(output_text, str) else type(output_text).__name__
        raise MathVerifyError(f"reference {str(reference)[:_MESSAGE_CHARS]!r}, output ending {tail!r}: {exc}") from exc


def extract_answer(text: str) -> Fraction | sympy.Basic | None:
    """The final answer in ``text`` (rules 1-4 of the module docstring), normalized.

    Returns:
        a ``Fraction`` for plain numbers, a sympy expression for LaTeX math parsed by
        math-verify, or None when the text has no answer.
    """
    text = text[-_MAX_TEXT_CHARS:]
    hashes = list(_HASH_RE.finditer(text))
    if hashes:
        value = _first_number(hashes[-1].group("span"))
        if value is not None:
            return value
    boxed = _last_boxed(text)
    if boxed is not None:
        value = _boxed_value(boxed)
        if value is not None:
            return value
    for match in list(_ANSWER_RE.finditer(text))[-_MAX_ANSWER_PHRASES:][::-1]:
        line_end = text.find("\n", match.end(), match.end() + _ANSWER_SPAN_CHARS)
        span = text[match.end():line_end if line_end >= 0 else match.end() + _ANSWER_SPAN_CHARS]
        value = _first_number(span.replace("*", " "))  # "is **42**"
        if value is not None:
            return value
    numbers = list(_NUMBER_RE.finditer(_clean(text)))
    return _number_value(numbers[-1]) if numbers else None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number if it is one number with optional decoration, else None.

    Accepts ``"1,234.50"``, ``"-$5"``, ``"$-5"``, ``"\\u22125"``, ``"3/4"``, ``"72 clips"``,
    ``"25%"``, ``"18\\text{ dollars}"``, ``"1{,}000"``; rejects ``"3 and 4"`` and ``""``.
    """
    cleaned = _clean(text).strip().rstrip(".").strip()
    match = _NUMBER_RE.match(cleaned)
    if match is None:
        return None
    rest = cleaned[match.end():].strip()
    if _NUMBER_RE.search(rest) or _LATEX_MATH_RE.search(rest):
        return None
    return _number_value(match)


# ----------------------------------------------------------------------------- helpers


@lru_cache(maxsize=4096)
def _parse_reference_cached(reference: str) -> Fraction | sympy.Basic:
    value = parse_number(reference)
    if value is not None:
        return value
    parsed = _mv_parse_safe(f"${reference}$") if _LATEX_MATH_RE.search(reference) else None
    if parsed is None:
        raise ValueError(f"math_reward: reference answer {reference!r} is not a number or expression")
    return parsed


def _parse_reference(reference: str | int | float | Fraction) -> Fraction | sympy.Basic:
    if isinstance(reference, Fraction):
        return reference
    if isinstance(reference, bool) or not isinstance(reference, (str, int, float)):
        raise ValueError(f"math_reward: reference answer {reference!r} has type {type(reference).__name__}")
    if isinstance(reference, float) and not math.isfinite(reference):
        raise ValueError(f"math_reward: reference answer {reference!r} is not finite")
    return _parse_reference_cached(str(reference) if not isinstance(reference, str) else reference)


def _clean(text: str) -> str:
    """Drop LaTeX decoration and turn LaTeX's ``{,}`` thousands separator into ``,``."""
    text = text.replace("{,}", ",")
    return _LATEX_DECOR_RE.sub(" ", text)


def _number_value(match: re.Match) -> Fraction | None:
    integer = (match.group("int") or "0").replace(",", "")
    try:
        value = Fraction(integer + (match.group("frac") or ""))
        if match.group("den") is not None:
            value /= Fraction(match.group("den"))
    except (ValueError, ZeroDivisionError):  # > 4300 digits, or x/0
        return None
    negative = any(match.group(g) in ("-", "\u2212") for g in ("sign", "sign2"))
    return -value if negative else value


def _first_number(span: str) -> Fraction | sympy.Basic | None:
    """Value of a marked span (after ``####`` or "answer is"): LaTeX math or its first number."""
    cleaned = _clean(span)
    if _LATEX_MATH_RE.search(cleaned):
        inner = cleaned.strip().rstrip(".").strip("$")
        return _mv_parse_safe(f"${inner}$")
    match = _NUMBER_RE.search(cleaned)
    return _number_value(match) if match else None


def _last_boxed(text: str) -> str | None:
    """Content of the last-closed ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or None.

    One pass over the braces with a stack, so unclosed boxes cost O(len(text)).
    """
    box_braces = {m.end() - 1 for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)}
    if not box_braces:
        return None
    stack: list[int] = []
    last = None
    for match in re.finditer(r"[{}]", text):
        if match.group() == "{":
            stack.append(match.start())
        elif stack:
            start = stack.pop()
            if start in box_braces:
                last = text[start + 1:match.start()]
    return last


def _boxed_value(content: str) -> Fraction | sympy.Basic | None:
    value = parse_number(content)
    if value is not None:
        return value
    return _mv_parse_safe(f"\\boxed{{{content}}}")


def _mv_parse_safe(latex: str) -> Fraction | sympy.Basic | None:
    """First sympy value math-verify extracts from ``latex``; None if it finds none.

    Inputs over ``_MATH_VERIFY_MAX_CHARS`` are not parsed: off the main thread math-verify
    runs without a timeout, and sympy on a huge expression could stall a reward worker.
    LaTeX math-verify cannot read is no answer (it returns nothing); math-verify raising or
    timing out is not "no answer" but an unknown reward: raises MathVerifyError.
    """
    if len(latex) > _MATH_VERIFY_MAX_CHARS:
        return None
    try:
        parsed = _mv_parse(latex, parsing_timeout=_timeout_s(), raise_on_error=True)
    except (Exception, _MathVerifyTimeout) as exc:  # noqa: BLE001 - every failure is reported, none scored
        raise MathVerifyError(f"math_verify.parse raised {type(exc).__name__}: {str(exc)[:200]}") from exc
    for item in parsed:
        if isinstance(item, sympy.Rational):
            return Fraction(int(item.p), int(item.q))
        if isinstance(item, sympy.Basic):
            return item
    return None


def _to_sympy(value: Fraction | sympy.Basic) -> sympy.Basic:
    if isinstance(value, Fraction):
        return sympy.Rational(value.numerator, value.denominator)
    return value


class MathVerifyError(RuntimeError):
    """math-verify failed (raised or timed out) parsing LaTeX or comparing two values: the
    sample's reward is unknown, not 0; the reward pool counts it as a failed sample
    (``reward.max_failure_fraction``) instead of training on a wrong 0."""


def _verify(gold: sympy.Basic, predicted: sympy.Basic) -> bool:
    """``math_verify.verify(gold, predicted)``. Raises MathVerifyError when it raises or times out."""
    try:
        return bool(_mv_verify(gold, predicted, timeout_seconds=_timeout_s(), raise_on_error=True))
    except (Exception, _MathVerifyTimeout) as exc:  # noqa: BLE001 - every failure is reported, none scored
        # the values are not printed: str() of a pathological sympy value can itself hang
        raise MathVerifyError(f"math_verify.verify raised {type(exc).__name__}: {str(exc)[:200]}") from exc


def _timeout_s() -> int | None:
    """math-verify's timeout uses SIGALRM, which only works on the main thread."""
    return 5 if threading.current_thread() is threading.main_thread() else None
