"""The import graph of maskc, read from the source with `ast` (nothing is imported).

The package is laid out by stage (`docs/design.md`), and the rules are between the stages'
folders: each folder imports only folders below it in `STAGES` (or itself), so no circle
runs between folders; no module takes part in an import circle either; `maskc/language/ir.py`
is the ground floor (it imports only the error hierarchy); the compiler never imports a
kernel, but for `maskc.attention`, which imports them when first called; and kernels read
only the compiled contract. Imports inside functions count like top-level ones (a
function-level import is how a circle hides); imports under `if TYPE_CHECKING:` do not,
since they never run.

Run `python tests/test_imports.py [--dot] [ROOT]` to print the graph of a checkout (one line
per imported module, `*` marking those imported only inside functions), its circles and the
rule violations, or with `--dot` the graph for Graphviz, e.g. to compare the graph before and
after a change.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The stages' folders, bottom up: a folder may import its own modules and those of the
# folders before it. Each is named by its package; `maskc` itself is the public face, which
# the command line and the test helpers use like any user.
STAGES = ["maskc.grammar", "maskc.language", "maskc.arrays", "maskc.analysis", "maskc.semantics",
          "maskc.compiled", "maskc.lowering.tuning", "maskc.lowering.grid",
          "maskc.lowering.closed_forms", "maskc.lowering", "maskc.tools", "maskc.config", "maskc.parallel", "maskc.kernels",
          "maskc.attention", "maskc.ir", "maskc._deprecated", "maskc", "maskc.testing",
          "maskc.cli", "maskc.flax", "maskc.torch"]

# The one module that imports the kernels, lazily inside its functions.
PUBLIC_FACE = "maskc.attention"
IR = "maskc.language.ir"
IR_MAY_IMPORT = {"maskc.language.errors"}
KERNELS = "maskc.kernels"
# What a kernel may import of maskc: the compiled contract (the BlockMap, its predicate
# and tile vocabulary, and the errors). `maskc.compiled.splash_info` is the BlockMap's splash format,
# reached through `BlockMap.splash()`, never imported by a kernel.
KERNEL_CONTRACT = {"maskc.compiled.blockmap", "maskc.compiled.predicate", "maskc.compiled.tiles", "maskc.language.errors"}


@dataclasses.dataclass(frozen=True)
class Edge:
  """One import of a maskc module by a maskc module.

  Attributes:
    source: the importing module, e.g. `maskc.language.parse`.
    target: the imported module, e.g. `maskc.language.ir` (for `from maskc import _ir`).
    line: the line of the import statement in the source file.
    in_function: whether the import runs inside a function (or method) body.
  """
  source: str
  target: str
  line: int
  in_function: bool


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """Every module of the installed package (everything under `maskc/`), by its dotted name,
  with its source file."""
  out = {}
  for path in sorted((root / "maskc").rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def stage(module: str) -> str:
  """The stage folder (an entry of `STAGES`) a module belongs to: the longest that holds it."""
  return max((s for s in STAGES if _under(module, s)), key=len)


def stage_violations(edges: list[Edge]) -> list[Edge]:
  """Imports of a module in a folder above the importer's (`STAGES`); the public face
  (`maskc/__init__.py`) may import any stage."""
  rank = {s: i for i, s in enumerate(STAGES)}
  return [e for e in edges if rank[stage(e.target)] > rank[stage(e.source)]]


def _is_type_checking(test: ast.expr) -> bool:
  """`if TYPE_CHECKING:`, `if typing.TYPE_CHECKING:` or an alias such as `_TYPE_CHECKING`."""
  return ((isinstance(test, ast.Name) and test.id.endswith("TYPE_CHECKING"))
          or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST):
  """Yields (import node, inside a function) for every import that can run."""
  stack: list[tuple[ast.AST, bool]] = [(tree, False)]
  while stack:
    node, in_function = stack.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node, in_function
      continue
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      stack.extend((child, in_function) for child in node.orelse)
      continue
    inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             known: set[str]) -> list[str]:
  """The maskc modules one import statement loads (its names, when they are modules)."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if node.level:  # relative: `from . import x`, `from ._common import y`
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
      package = package.rpartition(".")[0]
    base = f"{package}.{node.module}" if node.module else package
  else:
    base = node.module or ""
  out = []
  for alias in node.names:
    sub = f"{base}.{alias.name}"
    out.append(sub if sub in known else base)
  return out


def import_graph(root: pathlib.Path = ROOT) -> list[Edge]:
  """Every import of a maskc module by a maskc module, sorted by source, line and target."""
  files = module_files(root)
  known = set(files)
  edges = set()
  for module, path in files.items():
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node, in_function in _imports(tree):
      for target in _resolve(module, path.stem == "__init__", node, known):
        if target == "maskc" or target.startswith("maskc."):
          edges.add(Edge(module, target, node.lineno, in_function))
  return sorted(edges, key=lambda e: (e.source, e.line, e.target))


def cycles(edges: list[Edge]) -> list[list[str]]:
  """The import circles: strongly connected groups of two or more modules (or a self-import).

  Tarjan's algorithm, iteratively; each group is sorted, and the groups by their first member.
  """
  graph: dict[str, set[str]] = {}
  for e in edges:
    graph.setdefault(e.source, set()).add(e.target)
    graph.setdefault(e.target, set())
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  on_stack: set[str] = set()
  stack: list[str] = []
  groups: list[list[str]] = []
  for start in sorted(graph):
    if start in index:
      continue
    work = [(start, iter(sorted(graph[start])))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph[child]))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        group = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          group.append(member)
          if member == node:
            break
        if len(group) > 1 or node in graph[node]:
          groups.append(sorted(group))
  return sorted(groups)


def _cycle_edges(edges: list[Edge]) -> list[Edge]:
  """The edges that count for circles: all but the public face's lazy imports."""
  return [e for e in edges if not (e.source == PUBLIC_FACE and e.in_function)]


def _under(module: str, package: str) -> bool:
  return module == package or module.startswith(package + ".")


def _is_compiler(module: str) -> bool:
  return module.startswith("maskc.") and not _under(module, KERNELS) \
      and not _under(module, "maskc.grammar") and module != PUBLIC_FACE


def ir_violations(edges: list[Edge]) -> list[Edge]:
  """Imports of the IR module beyond the error hierarchy."""
  return [e for e in edges if e.source == IR and e.target not in IR_MAY_IMPORT]


def compiler_to_kernel_violations(edges: list[Edge]) -> list[Edge]:
  """Imports of a kernel by a compiler module (all of `maskc` but `maskc.attention`)."""
  return [e for e in edges if _is_compiler(e.source) and _under(e.target, KERNELS)]


def kernel_violations(edges: list[Edge]) -> list[Edge]:
  """Imports by a kernel module of maskc beyond the contract and the kernels themselves."""
  return [e for e in edges if _under(e.source, KERNELS) and not _under(e.target, KERNELS)
          and e.target not in KERNEL_CONTRACT]


def _show(edges: list[Edge], indent: str = "  ") -> str:
  return "\n".join(f"{indent}{e.source} -> {e.target}  "
                   f"(line {e.line}{', in a function' * e.in_function})" for e in edges)


def _pairs(edges: list[Edge]) -> dict[tuple[str, str], bool]:
  """Each (source, target) once, with whether every one of its imports sits in a function."""
  out: dict[tuple[str, str], bool] = {}
  for e in edges:
    out[e.source, e.target] = out.get((e.source, e.target), True) and e.in_function
  return out


def report(edges: list[Edge]) -> str:
  """The graph (one line per imported module), its circles and the rule violations, as text."""
  lines = ["import graph (`*`: imported only inside functions):"]
  width = max(len(e.source) for e in edges)
  for (source, target), lazy in _pairs(edges).items():
    lines.append(f"  {source:<{width}} -> {target}{' *' if lazy else ''}")
  found = cycles(_cycle_edges(edges))
  lines.append(f"circles: {len(found)}")
  for group in found:
    lines.append(f"  {' <-> '.join(group)}, by the imports")
    lines.append(_show([e for e in _cycle_edges(edges)
                        if e.source in group and e.target in group], indent="    "))
  for title, bad in (("a stage imports one above it", stage_violations(edges)),
                     ("the IR imports", ir_violations(edges)),
                     ("the compiler imports a kernel", compiler_to_kernel_violations(edges)),
                     ("a kernel imports compiler internals", kernel_violations(edges))):
    lines.append(f"{title}: {len(bad)}")
    if bad:
      lines.append(_show(bad))
  return "\n".join(lines)


def dot(edges: list[Edge]) -> str:
  """The graph in Graphviz's language (`dot -Tsvg`), imports inside functions dashed."""
  lines = ["digraph maskc {", "  rankdir=BT; node [shape=box, fontname=monospace];"]
  for (source, target), lazy in _pairs(edges).items():
    lines.append(f'  "{source}" -> "{target}"{" [style=dashed]" if lazy else ""};')
  return "\n".join(lines + ["}"])


# ----------------------------------------------------------------------------- the rules


def test_the_graph_is_read_from_every_stage():
  edges = import_graph()
  sources = {stage(e.source) for e in edges}
  # A module of each stage, and both kinds of import, so the rules below see them.
  # they import no maskc module
  leaves = {"maskc.grammar", "maskc.arrays", "maskc.lowering.tuning", "maskc._deprecated"}
  assert set(STAGES) - leaves <= sources, set(STAGES) - leaves - sources
  assert ("maskc.language.parse", "maskc.language.ir") in {(e.source, e.target) for e in edges}
  assert any(e.source == PUBLIC_FACE and e.in_function and _under(e.target, KERNELS)
             for e in edges)
  assert set(module_files()) >= {"maskc.lowering.closed_forms.band_runs", "maskc.kernels.xla"}


def test_each_stage_imports_only_the_stages_below_it():
  bad = stage_violations(import_graph())
  assert not bad, "imports of a stage above the importer's (see STAGES):\n" + _show(bad)


def test_no_import_circles():
  found = cycles(_cycle_edges(import_graph()))
  assert not found, "import circles:\n" + "\n".join(" <-> ".join(g) for g in found)


def test_the_ir_imports_only_the_errors():
  bad = ir_violations(import_graph())
  assert not bad, "maskc/language/ir.py must import no maskc module but the errors:\n" + _show(bad)


def test_the_errors_module_is_a_leaf():
  bad = [e for e in import_graph() if e.source == "maskc.language.errors"]
  assert not bad, "maskc/language/errors.py must import no maskc module:\n" + _show(bad)


def test_the_compiler_imports_no_kernel():
  bad = compiler_to_kernel_violations(import_graph())
  assert not bad, "compiler modules import kernels:\n" + _show(bad)


def test_kernels_import_only_the_contract():
  bad = kernel_violations(import_graph())
  assert not bad, "kernels import compiler internals:\n" + _show(bad)


# ----------------------------------------------------------------------------- the checker itself


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
  return root


def test_the_reader_resolves_every_import_form(tmp_path):
  root = _write(tmp_path, {
      "maskc/__init__.py": "from maskc.lowering.compile import f\n",
      "maskc/attention.py": "def attention():\n  from maskc.kernels.api import g\n",
      "maskc/lowering/__init__.py": "",
      "maskc/lowering/compile.py": "from maskc.lowering import static as s\nimport maskc.tools\n"
                                   "from maskc import parse\nfrom typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n  from maskc import config\n"
                                   "else:\n  import maskc.parallel\n"
                                   "if typing.TYPE_CHECKING:\n  import maskc.config\n",
      "maskc/lowering/static.py": "import numpy\n", "maskc/tools/__init__.py": "",
      "maskc/config/__init__.py": "", "maskc/parallel/__init__.py": "",
      "maskc/kernels/__init__.py": "from . import api\n",
      "maskc/kernels/api.py": "from .common import x\nfrom ..lowering import static\n"
                              "class K:\n  def m(self):\n    import maskc.lowering.compile\n",
      "maskc/kernels/common.py": "", "maskc/grammar/__init__.py": ""})
  got = {(e.source, e.target, e.in_function) for e in import_graph(root)}
  assert got == {
      ("maskc", "maskc.lowering.compile", False),
      ("maskc.attention", "maskc.kernels.api", True),
      ("maskc.lowering.compile", "maskc.lowering.static", False),
      ("maskc.lowering.compile", "maskc.tools", False),
      ("maskc.lowering.compile", "maskc", False),
      ("maskc.lowering.compile", "maskc.parallel", False),
      ("maskc.kernels", "maskc.kernels.api", False),
      ("maskc.kernels.api", "maskc.kernels.common", False),
      ("maskc.kernels.api", "maskc.lowering.static", False),
      ("maskc.kernels.api", "maskc.lowering.compile", True)}


def test_the_rules_catch_each_kind_of_violation(tmp_path):
  root = _write(tmp_path, {
      "maskc/__init__.py": "from maskc import attention\n",
      "maskc/attention.py": "def attention():\n  from maskc.kernels import api\n",
      "maskc/language/__init__.py": "", "maskc/language/errors.py": "",
      "maskc/language/ir.py": "from maskc.language.errors import E\n"
                              "def f():\n  from maskc.language import printer\n",
      "maskc/language/printer.py": "from maskc.language import ir\n",
      "maskc/semantics/__init__.py": "", "maskc/semantics/bind.py": "from maskc.lowering import x\n",
      "maskc/lowering/__init__.py": "", "maskc/lowering/x.py": "",
      "maskc/lowering/splash.py": "def f():\n  from maskc.kernels.common import x\n",
      "maskc/kernels/__init__.py": "",
      "maskc/kernels/common.py": "from maskc.compiled.blockmap import B\n",
      "maskc/kernels/api.py": "import maskc\nfrom maskc.language.errors import E\n",
      "maskc/compiled/__init__.py": "", "maskc/compiled/blockmap.py": "",
      "maskc/grammar/__init__.py": ""})
  edges = import_graph(root)
  assert cycles(_cycle_edges(edges)) == [["maskc.language.ir", "maskc.language.printer"]]
  assert [(e.source, e.target) for e in ir_violations(edges)] == [
      ("maskc.language.ir", "maskc.language.printer")]
  assert [(e.source, e.target) for e in compiler_to_kernel_violations(edges)] == [
      ("maskc.lowering.splash", "maskc.kernels.common")]
  assert [(e.source, e.target) for e in kernel_violations(edges)] == [
      ("maskc.kernels.api", "maskc")]
  assert {(e.source, e.target) for e in stage_violations(edges)} == {
      ("maskc.semantics.bind", "maskc.lowering.x"), ("maskc.kernels.api", "maskc"),
      ("maskc.lowering.splash", "maskc.kernels.common")}


def test_cycles_finds_every_circle_and_self_import():
  def edges(*pairs):
    return [Edge(a, b, 1, False) for a, b in pairs]
  assert cycles(edges(("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"))) == [["a", "b", "c"]]
  assert cycles(edges(("a", "b"), ("b", "a"), ("c", "d"), ("d", "c"), ("b", "c"))) == [
      ["a", "b"], ["c", "d"]]
  assert cycles(edges(("a", "a"), ("a", "b"))) == [["a"]]
  assert cycles(edges(("a", "b"), ("b", "c"), ("a", "c"))) == []


if __name__ == "__main__":
  # python tests/test_imports.py [--dot] [ROOT]: the graph as text (or Graphviz) for a checkout.
  args = [a for a in sys.argv[1:] if a != "--dot"]
  graph = import_graph(pathlib.Path(args[0]) if args else ROOT)
  print(dot(graph) if "--dot" in sys.argv[1:] else report(graph))
