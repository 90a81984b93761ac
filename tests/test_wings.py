"""The package's shape: a small public face, wings that stack, and no import cycle.

Read from the source with ``ast`` (imports inside functions included), so a cycle hidden behind a
function-level import fails here as surely as one at the top of a module.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "redcoast"

# The wings and public modules from the bottom up: each may import those on its own row or
# below, never above. A public module is a row entry of its own; a wing (a subpackage) is one
# entry for all its modules. The README's Layout section draws the same map, a row a line.
STACK = [
    ("errors", "simulate", "train_state"),
    ("sharding",),
    ("multihost",),
    ("store",),
    ("validate", "export", "lora", "data", "progress", "callbacks", "schedules", "logs"),
    ("models",),
    ("layout",),
    ("loop",),
    ("deployer", "predictor"),
    ("trainer",),
    ("text",),
    ("compat",),
    ("__init__", "__main__", "cli"),  # the entry points: the face and the commands
]
RANK = {unit: row for row, units in enumerate(STACK) for unit in units}
MAX_TOP_LEVEL_MODULES = 16


def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_package(name):
    return MODULES[name].name == "__init__.py"


def _imports(name):
    """``(line, imported module, via package __init__ names)`` for every import in module ``name``."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "redcoast":
                    yield node.lineno, _existing(alias.name), []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if _is_package(name) else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "redcoast":
                continue
            names_from_init = []
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    yield node.lineno, f"{source}.{alias.name}", []
                else:
                    names_from_init.append(alias.name)
            if names_from_init:
                yield node.lineno, _existing(source), names_from_init


def _existing(dotted):
    while dotted not in MODULES:
        dotted = dotted.rsplit(".", 1)[0]
    return dotted


def _unit(name):
    """The stack's entry of a module: its wing, or itself for a public module."""
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


GRAPH = {name: {target for _, target, _ in _imports(name) if target != name} for name in MODULES}


def test_the_public_face_is_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(top)} modules directly under redcoast/ ({top}); put the new one in the wing that "
        "owns its idea")


def test_every_module_has_its_place_in_the_stack():
    units = {_unit(name) for name in MODULES}
    assert units <= set(RANK), f"not in STACK: {sorted(units - set(RANK))}"


def test_no_wing_imports_one_above_it():
    upward = [f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} imports {target} "
              f"({_unit(target)}, row {RANK[_unit(target)]} above its row {RANK[_unit(name)]})"
              for name in MODULES for line, target, _ in _imports(name)
              if RANK[_unit(target)] > RANK[_unit(name)]]
    assert not upward, "\n".join(upward)


def test_no_module_imports_its_siblings_through_its_own_package():
    through = [f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} imports {names} from "
               f"{target}/__init__.py; import them from the module that defines them"
               for name in MODULES for line, target, names in _imports(name)
               if names and target != "redcoast" and not _is_package(name)
               and name.rsplit(".", 1)[0] == target]
    assert not through, "\n".join(through)


def test_no_import_cycle():
    """Depth-first search for a back edge; the message is the cycle itself."""
    state, stack = {}, []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for target in sorted(GRAPH[name]):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name)


def test_the_checks_see_what_they_check():
    """The graph the tests read has the edges any reader sees (guards against an AST walk
    that silently finds nothing): the Trainer imports the loop, the loop the layout, and a
    function-level import is an edge."""
    assert "redcoast.loop.fit_run" in GRAPH["redcoast.trainer"]
    assert "redcoast.layout.layout" in GRAPH["redcoast.loop.initial_state"]
    assert "redcoast.cli.plan_command" in GRAPH["redcoast.cli.main"]  # inside cli()


def test_the_mesh_axis_names_are_written_once():
    """'dp' and 'mp' as values in code live in sharding/axes.py only (docstrings and messages may
    name them): a mesh built or read elsewhere uses DATA_AXIS, MODEL_AXIS, MESH_AXES."""
    bare = []
    for name, path in MODULES.items():
        if name == "redcoast.sharding.axes":
            continue
        tree = ast.parse(path.read_text())
        texts = {id(node.body[0].value) for node in ast.walk(tree)
                 if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                 and node.body and isinstance(node.body[0], ast.Expr)}
        bare += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.value!r}"
                 for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and node.value in ("dp", "mp") and id(node) not in texts]
    assert not bare, "use redcoast.sharding.axes' names: " + ", ".join(bare)


# Names defined in more than one module on purpose: each model family's module answers the same
# questions (its Config, example inputs, Hugging Face names) with its own building blocks; redco's
# classes keep their names in compat/; each command has its main.
SAME_NAME_BY_DESIGN = {
    "Config", "example_inputs", "hf_sources", "config_for_tensors",
    "Attention", "Block", "_linear", "_layer_norm", "shift_right",
    "Trainer", "Deployer", "Predictor", "main",
}
# Still defined twice, to be renamed or made one (issue 47): a test that lists them, so that a
# new duplicate fails and one made unique must leave this list.
SAME_NAME_NOT_YET = {
    "Candidate", "estimate",                 # layout/ vs cli/plan_search.py
    "damaged", "load_params",                # GGUF vs safetensors; export vs models/hf
    "positive_int", "seconds", "changes",    # validate/cli arguments; run records vs resumes
    "generate", "_generate", "_jitted",      # models/generate_seq2seq.py repeats generate.py
}


def test_no_two_modules_define_the_same_name():
    defined = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.setdefault(node.name, []).append(name)
    twice = {k: v for k, v in defined.items() if len(v) > 1}
    new = {k: v for k, v in twice.items() if k not in SAME_NAME_BY_DESIGN | SAME_NAME_NOT_YET}
    assert not new, f"defined in several modules: {new}; name each for what it does"
    assert SAME_NAME_NOT_YET <= set(twice), ("now defined once, take it off SAME_NAME_NOT_YET: "
                                             f"{sorted(SAME_NAME_NOT_YET - set(twice))}")


def _loops_over_equations(tree):
    """Lines where a loop or comprehension runs over some program's ``.eqns`` (directly, or
    through enumerate/reversed/zip, or range(len(....eqns)))."""
    def is_eqns(node):
        if isinstance(node, ast.Attribute) and node.attr == "eqns":
            return True
        if isinstance(node, ast.Call):
            return any(is_eqns(a) for a in node.args)
        return False
    found = []
    for node in ast.walk(tree):
        iters = [node.iter] if isinstance(node, (ast.For, ast.comprehension)) else []
        found += [getattr(node, "lineno", getattr(it, "lineno", 0)) for it in iters if is_eqns(it)]
    return found


def test_only_the_interpreter_walks_a_programs_equations():
    """The rewrites and analyses are rules over sharding/interpreter.py (evaluate, follow,
    total, evaluate_on_demand, where): a new JAX form is taught in one place."""
    walkers = {name: lines for name, path in MODULES.items()
               if (lines := _loops_over_equations(ast.parse(path.read_text())))}
    assert set(walkers) == {"redcoast.sharding.interpreter"}, walkers
