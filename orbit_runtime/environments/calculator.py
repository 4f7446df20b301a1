"""The built-in calculator tool: arithmetic on numbers, evaluated from the expression's syntax
tree (never `eval`), with bounds so a model cannot make it compute forever."""

from __future__ import annotations

import ast
import math
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION = 200  # characters
MAX_MAGNITUDE = 10**18  # operands and results; a power is refused before it is computed if it would exceed it


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. 12*(3+4)
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and abs(right) * math.log2(abs(left)) > 64:
            raise ValueError("the power is too large")  # refused before it is computed
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the number is too large") from None
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        return _bounded(value)
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def _bounded(value: int | float) -> int | float:
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError("the number is too large")
    return value
