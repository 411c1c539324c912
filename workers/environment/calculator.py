"""The calculator tool's evaluator: arithmetic on Python's syntax tree, never `eval`.

Only numbers, + - * / // % **, unary minus and plus, parentheses and `sqrt(x)` are evaluated; anything else (a name,
an attribute, any other call) is refused. Sizes are bounded before the work is done, so `9**9**9` is refused at
once instead of hanging the worker.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 1000
"""Longer expressions are refused unparsed: this also bounds how many operations one call can do."""
MAX_INTEGER_BITS = 4096
"""About 1,230 decimal digits: far past what a task asks for, yet any operation on two such integers takes
microseconds (and their decimal text stays under Python's int-to-str limit of 4,300 digits)."""

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
FUNCTIONS = {"sqrt": math.sqrt}

Number = int | float


class CalculatorError(ValueError):
    """The expression is refused or cannot be evaluated; the message is what the policy reads."""


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        # RecursionError, MemoryError: deeply nested parentheses.
        raise CalculatorError("not an arithmetic expression") from None
    try:
        value = evaluate(tree.body)
    except OverflowError:
        raise CalculatorError("result too large") from None
    except (ZeroDivisionError, ValueError, RecursionError) as error:
        raise CalculatorError(str(error) or type(error).__name__) from None
    return repr(value)


def evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            check_power(left, right)
        return checked(BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("^ is not a power here: write ** (2 ** 10)")
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and len(node.args) == 1 and not node.keywords):
        return checked(FUNCTIONS[node.func.id](evaluate(node.args[0])))
    raise CalculatorError(f"not allowed: {ast.unparse(node)!r} (only numbers, + - * / // % **, parentheses and "
                          f"sqrt())")


def check_power(base: Number, exponent: Number) -> None:
    """Refuse an integer power whose result would pass MAX_INTEGER_BITS, before computing it."""
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * (abs(base).bit_length() - 1) > MAX_INTEGER_BITS:
            raise CalculatorError(f"result too large (over {MAX_INTEGER_BITS} bits)")


def checked(value: object) -> Number:
    """The value if it is a finite real number of bounded size."""
    if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
        raise CalculatorError(f"result too large (over {MAX_INTEGER_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    if not isinstance(value, (int, float)):
        raise CalculatorError("result is not a real number")
    return value
