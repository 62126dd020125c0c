"""Source rewriting for the Python tool: print the last bare expression (spec §4).

The official tool wraps a final bare expression in `print(...)` so that `x**2` as the last line shows its value.
We do the same by editing only the last statement's characters, so line numbers in tracebacks stay those of
the model's code. Code that does not parse is returned unchanged; Python then reports the SyntaxError itself.
"""

import ast


def _is_print_call(node: ast.expr) -> bool:
  return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"


def wrap_last_expression(code: str) -> str:
  """Returns `code` with its last top-level bare expression wrapped in print(...).

  A final `print(...)` call is left alone (wrapping it would print "None"). Like the official tool, any other
  final expression is printed, including calls that return None.
  """
  try:
    tree = ast.parse(code)
  except (SyntaxError, ValueError):
    return code
  if not tree.body or not isinstance(tree.body[-1], ast.Expr) or _is_print_call(tree.body[-1].value):
    return code
  node = tree.body[-1].value
  # ast offsets are (1-based line, UTF-8 byte column): convert them to string indices.
  lines = code.splitlines(keepends=True)

  def _index(lineno: int, col_bytes: int) -> int:
    prefix = sum(len(line) for line in lines[: lineno - 1])
    return prefix + len(lines[lineno - 1].encode("utf-8")[:col_bytes].decode("utf-8", errors="ignore"))

  start = _index(node.lineno, node.col_offset)
  end = _index(node.end_lineno, node.end_col_offset)
  return code[:start] + "print(" + code[start:end] + ")" + code[end:]
