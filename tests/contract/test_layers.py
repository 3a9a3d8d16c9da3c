"""One-way layers: the import graph of ``mtp_overlay`` (product and test bed) has no circle, every import
points down the layers (the product's, then the bed's own), the product reaches the bed only through its
named doors, the bed imports nothing private of another module, and ``import mtp_overlay`` loads only
the generated table, the registry and the import trigger.

Product: every module of ``mtp_overlay`` but ``mtp_overlay.bed`` (the test bed, which imports the
product) and ``mtp_overlay.upstream_tests`` (tests shipped with the package). Imports inside functions
count. The product's ways to the bed: the CLI's ``demo`` and ``check --run`` import it inside those
commands, and ``verify`` runs its engine in a child process (``verification.engine.ENGINE_MODULE``).
"""

import ast
import subprocess
import sys
from pathlib import Path

import mtp_overlay
from mtp_overlay import declarations

PACKAGE = Path(mtp_overlay.__file__).parent
TEST_CODE = ("bed", "upstream_tests")
ALLOWED = {("cli.py", "_demo"), ("cli.py", "_check")}  # (module file, function) that may import the test bed
# a product module may import only modules of a lower layer, or of its own package; the first part of
# its name below mtp_overlay decides (fixes: the Fix base and every fix; mtp: the trainer library)
LAYERS = (
    {"contract", "calls", "table", "startup"},  # import nothing of ours
    {"hooks", "declarations", "mtp"},
    {"lifecycle"},
    {"fixes"},
    {"patching", "generated"},
    {"registry", "scaffold", "verification"},
    {"cli", "__init__"},
)
# the bed's layers, by the part of its name below mtp_overlay.bed (plugin and the package: the top)
BED_LAYERS = (
    {"runtime"},  # ranks, device, CPU stand-ins
    {"oracles"},  # references from first principles
    {"models"},
    {"steps"},
    {"fixes"},  # reproducers
    {"engines"},
    {"plugin", "__init__"},
)


def all_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE), path


def product_modules():
    return ((relative, path) for relative, path in all_modules() if relative.parts[0] not in TEST_CODE)


def bed_modules():
    return ((relative, path) for relative, path in all_modules() if relative.parts[0] == "bed")


def module_name(relative):
    parts = ("mtp_overlay",) + relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree, module, is_package):
    """(imported module name, enclosing function name or None) of every import statement."""
    package = module if is_package else module.rpartition(".")[0]

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Import):
                yield from ((alias.name, function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                yield base, function
                yield from ((f"{base}.{alias.name}", function) for alias in child.names)
            yield from visit(child, inner)

    yield from visit(tree, None)


def import_graph(modules=None):
    """module -> the modules of ``modules`` (default: the product's) it imports (anywhere in it),
    ``mtp_overlay`` itself left out (every submodule's import runs it: it is the top, not an edge)."""
    modules = {module_name(relative): (relative, path) for relative, path in (modules or product_modules())}
    graph = {}
    for name, (relative, path) in modules.items():
        found = set()
        for imported, _ in imported_names(ast.parse(path.read_text(), str(path)), name, relative.name == "__init__.py"):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported not in (name, "mtp_overlay"):
                found.add(imported)
        graph[name] = found
    return graph


def circle(graph):
    """One import circle of ``graph`` as a list of modules (first == last), or None."""
    state, stack = {}, []

    def walk(node):
        state[node] = "open"
        stack.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == "open":
                return stack[stack.index(other):] + [other]
            if other not in state and (found := walk(other)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    return next((found for node in sorted(graph) if node not in state and (found := walk(node))), None)


def layer(module):
    part = module.split(".")[1] if "." in module else "__init__"
    return next(index for index, names in enumerate(LAYERS) if part in names)


def bed_layer(module):
    parts = module.split(".")
    part = parts[2] if len(parts) > 2 else "__init__"
    return next(index for index, names in enumerate(BED_LAYERS) if part in names)


def test_the_import_graph_has_no_circle():
    assert circle(import_graph(all_modules())) is None


def test_every_bed_import_points_down_the_bed_layers():
    graph = import_graph(bed_modules())
    upward = [f"{module} imports {other}" for module, imported in graph.items() for other in imported
              if bed_layer(other) > bed_layer(module)]
    assert upward == []


def test_the_bed_imports_nothing_private_of_another_module():
    """Neither ``from .x import _name`` nor ``x._name`` off a bed module it imported (``vllm_drafter._state``)."""
    modules = {module_name(relative) for relative, _ in all_modules()}
    private = []
    for relative, path in bed_modules():
        module, tree = module_name(relative), ast.parse(path.read_text(), str(path))
        bound = {}  # local name -> the module object it names, for names bound by ``from ... import``
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = next(name for name, _ in imported_names(ast.Module([node], []), module,
                                                               relative.name == "__init__.py"))
                bound.update({alias.asname or alias.name: f"{base}.{alias.name}" for alias in node.names})
                if base.startswith("mtp_overlay") and base != module:
                    private += [f"{relative}: {base}.{alias.name}" for alias in node.names
                                if alias.name.startswith("_") and f"{base}.{alias.name}" not in modules]
        private += [f"{relative}:{node.lineno}: {bound[node.value.id]}.{node.attr}" for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and bound.get(node.value.id) in modules and bound[node.value.id] != module
                    and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert private == []


def test_every_product_import_points_down_the_layers():
    upward = [f"{module} imports {other}" for module, imported in import_graph().items() for other in imported
              if layer(other) > layer(module) or (layer(other) == layer(module) and
                                                  other.split(".")[:2] != module.split(".")[:2])]
    assert upward == []


def test_the_graph_tests_see_a_circle_and_a_function_level_import():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("def reproduce():\n    from ...bed.runtime.launcher import run_ranks\n")
    names = list(imported_names(tree, "mtp_overlay.fixes.some_fix", is_package=True))
    assert ("mtp_overlay.bed.runtime.launcher", "reproduce") in names
    assert bed_layer("mtp_overlay.bed.runtime.launcher") < bed_layer("mtp_overlay.bed.models.tiny_gpt")
    assert bed_layer("mtp_overlay.bed.fixes.mtp_loss_mask") < bed_layer("mtp_overlay.bed.engines.demo")
    assert layer("mtp_overlay.contract") < layer("mtp_overlay.lifecycle") < layer("mtp_overlay.registry")
    assert layer("mtp_overlay.patching.survey") < layer("mtp_overlay.registry")


def fix_of(module):
    """The fix id whose folder holds product module ``module`` (``mtp_overlay.fixes.<fix id with _>...``),
    or None (a shared fixes module such as ``fixes.peers``, or no fix at all)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "fixes" and (PACKAGE / "fixes" / parts[2] / "declaration.py").is_file():
        return parts[2].replace("_", "-")
    return None


def unnamed_fix_imports(graph, named):
    """Every import of ``graph`` from one fix's module into another fix's that ``named`` (fix id -> the fix
    ids its declaration's ``requires`` and ``reads`` name) does not allow."""
    found = []
    for module, imported in sorted(graph.items()):
        importer = fix_of(module)
        for other in sorted(imported):
            fix = fix_of(other)
            if importer is not None and fix not in (None, importer) and fix not in named(importer):
                found.append(f"{module} imports {other}: fix {importer} names {fix} in neither requires nor reads")
    return found


def test_a_fix_imports_another_fix_only_where_its_declaration_names_it():
    """Fix-to-fix imports (function-level ones included) follow the declarations: what two fixes share
    lives in a shared fixes module (``fixes.combined_inputs``, ``fixes.peers``) or in ``mtp``."""

    def named(fix_id):
        declaration = declarations.load(fix_id)
        return set(declaration.requires) | set(declaration.reads)

    assert unnamed_fix_imports(import_graph(), named) == []
    # mtp-loss-mask once imported mtp-multimodal's scope, a fix that requires it: the check sees that
    old = {"mtp_overlay.fixes.mtp_loss_mask": {"mtp_overlay.fixes.mtp_multimodal.llava", "mtp_overlay.fixes.peers"}}
    assert unnamed_fix_imports(old, named) == [
        "mtp_overlay.fixes.mtp_loss_mask imports mtp_overlay.fixes.mtp_multimodal.llava: fix mtp-loss-mask names "
        "mtp-multimodal in neither requires nor reads"]
    assert unnamed_fix_imports({"mtp_overlay.fixes.mtp_multimodal": {"mtp_overlay.fixes.mtp_loss_mask"}}, named) == []


def test_no_product_module_imports_the_test_bed():
    offenders = []
    for relative, path in product_modules():
        module = module_name(relative)
        tree = ast.parse(path.read_text(), str(path))
        for name, function in imported_names(tree, module, relative.name == "__init__.py"):
            if (name + ".").startswith("mtp_overlay.bed.") and (relative.as_posix(), function) not in ALLOWED:
                offenders.append(f"{relative}: imports {name}" + (f" in {function}()" if function else ""))
    assert offenders == []


def test_verify_names_a_bed_engine_that_exists():
    """The product's third door to the bed is a module name run as a child process: it must name a module
    of the bed's engines that exists (a rename of the bed breaks this test, not a user's ``verify``)."""
    from mtp_overlay.verification.engine import ENGINE_MODULE

    assert ENGINE_MODULE.startswith("mtp_overlay.bed.engines.")
    assert (PACKAGE / Path(*ENGINE_MODULE.split(".")[1:])).with_suffix(".py").is_file()


def test_import_loads_only_the_table_the_registry_and_the_trigger():
    code = "import sys; before = set(sys.modules); import mtp_overlay; print(sorted(set(sys.modules) - before))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(loaded) == ["mtp_overlay", "mtp_overlay.hooks", "mtp_overlay.registry", "mtp_overlay.table"]


def test_every_product_module_imports_without_the_test_bed():
    modules = [module_name(relative) for relative, _ in product_modules()]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('mtp_overlay.bed')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
