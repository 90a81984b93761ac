"""Lines of code of Python scripts, as their length is compared with other projects' examples:
every line, and the lines that hold code (not blank, not only a comment, not in a docstring).

    python benchmarks/code_lines.py examples/sft/main.py path/to/trl/scripts/sft.py ...

A licence header, a usage docstring and comments are what differ most between projects'
scripts; code lines leave them out.
"""

import ast
import io
import sys
import tokenize


def code_lines(source):
    """The number of lines of ``source`` holding code."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


if __name__ == "__main__":
    print(f"{'code':>6}{'lines':>7}  file")
    for path in sys.argv[1:]:
        with open(path) as f:
            source = f.read()
        print(f"{code_lines(source):>6}{len(source.splitlines()):>7}  {path}")
