"""The import graph of maskc, read from the source with `ast` (nothing is imported).

The package is laid out by stage (`docs/design.md`), and the rules are between the stages'
folders: each folder imports only folders below it in `STAGES` (or itself), so no circle
runs between folders; no module takes part in an import circle either; `maskc/language/ir.py`
is the ground floor (it imports only the error hierarchy); the compiler never imports a
kernel, but for `maskc.attention`, which imports them when first called; and kernels read
only the compiled contract; the compiler imports no Pallas and no tokamax, and `import maskc`
loads neither. No module uses another's private names (`_x`), but for a private module of its
own package. Imports inside functions count like top-level ones (a function-level import is
how a circle hides), and so do imports under `if TYPE_CHECKING:`: a circle of types is a
circle of meaning, which a lower stage resolves by naming what it needs (a protocol) instead.

Run `python tests/test_imports.py [--dot] [ROOT]` to print the graph of a checkout (one line
per imported module, `*` marking those imported only inside functions), its circles and the
rule violations, or with `--dot` the graph for Graphviz, e.g. to compare the graph before and
after a change.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The stages' folders, bottom up: a folder may import its own modules and those of the
# folders before it. Each is named by its package; `maskc` itself is the public face, which
# the command line and the test helpers use like any user.
STAGES = ["maskc.grammar", "maskc.language", "maskc.arrays", "maskc.analysis", "maskc.semantics",
          "maskc.compiled", "maskc.lowering.tuning", "maskc.lowering.grid", "maskc.lowering.rules",
          "maskc.lowering.generic", "maskc.lowering.closed_forms", "maskc.lowering", "maskc.tools",
          "maskc.config", "maskc.parallel", "maskc.kernels", "maskc.formats", "maskc.attention",
          "maskc.ir", "maskc._deprecated", "maskc", "maskc.testing", "maskc.cli", "maskc.flax",
          "maskc.torch"]

# The one module that imports the kernels, lazily inside its functions.
PUBLIC_FACE = "maskc.attention"
IR = "maskc.language.ir"
IR_MAY_IMPORT = {"maskc.language.errors"}
KERNELS = "maskc.kernels"
# What a kernel may import of maskc: the compiled contract (the BlockMap, its predicate
# and tile vocabulary, and the errors). Kernel formats (splash's MaskInfo) are the kernels'
# own, built from the BlockMap (`maskc.kernels.splash.mask_info(bm)`).
KERNEL_CONTRACT = {"maskc.compiled.blockmap", "maskc.compiled.predicate", "maskc.compiled.tiles",
                   "maskc.language.errors"}
# Packages the compiler never imports, not even lazily: the kernels' own (Pallas and
# tokamax), which `import maskc` must not load.
KERNEL_PACKAGES = ("jax.experimental.pallas", "jax._src.pallas", "tokamax")


@dataclasses.dataclass(frozen=True)
class Edge:
  """One import of a maskc module by a maskc module.

  Attributes:
    source: the importing module, e.g. `maskc.language.parse`.
    target: the imported module, e.g. `maskc.language.ir` (for `from maskc import _ir`).
    line: the line of the import statement in the source file.
    in_function: whether the import runs inside a function (or method) body.
    type_checking: whether it sits under `if TYPE_CHECKING:` (for type checkers only).
  """
  source: str
  target: str
  line: int
  in_function: bool
  type_checking: bool = False


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
  """Yields (import node, inside a function, under `if TYPE_CHECKING:`) for every import."""
  stack: list[tuple[ast.AST, bool, bool]] = [(tree, False, False)]
  while stack:
    node, in_function, typing_only = stack.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node, in_function, typing_only
      continue
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      stack.extend((child, in_function, True) for child in node.body)
      stack.extend((child, in_function, typing_only) for child in node.orelse)
      continue
    inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    stack.extend((child, inner, typing_only) for child in ast.iter_child_nodes(node))


def _from_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
  """The module a `from ... import` statement imports from, relative levels resolved."""
  if not node.level:
    return node.module or ""
  package = module if is_package else module.rpartition(".")[0]
  for _ in range(node.level - 1):
    package = package.rpartition(".")[0]
  return f"{package}.{node.module}" if node.module else package


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             known: set[str]) -> list[str]:
  """The modules one import statement loads (its names, when they are maskc modules)."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  base = _from_base(module, is_package, node)
  out = []
  for alias in node.names:
    sub = f"{base}.{alias.name}"
    out.append(sub if sub in known else base)
  return out


def import_graph(root: pathlib.Path = ROOT) -> list[Edge]:
  """Every import of a maskc module by a maskc module, sorted by source, line and target."""
  return [e for e in all_imports(root) if e.target == "maskc" or e.target.startswith("maskc.")]


def all_imports(root: pathlib.Path = ROOT) -> list[Edge]:
  """Every import by a maskc module, of maskc or of any other package (`jax.numpy`, ...)."""
  files = module_files(root)
  known = set(files)
  edges = set()
  for module, path in files.items():
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node, in_function, typing_only in _imports(tree):
      for target in _resolve(module, path.stem == "__init__", node, known):
        edges.add(Edge(module, target, node.lineno, in_function, typing_only))
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


def kernel_package_violations(edges: list[Edge]) -> list[Edge]:
  """Imports of Pallas or tokamax (`KERNEL_PACKAGES`) by a compiler module, lazy ones too:
  only the kernels (and `maskc.attention`, which calls them) may import them."""
  return [e for e in edges if _is_compiler(e.source)
          and any(_under(e.target, p) for p in KERNEL_PACKAGES)]


def kernel_violations(edges: list[Edge]) -> list[Edge]:
  """Imports by a kernel module of maskc beyond the contract and the kernels themselves."""
  return [e for e in edges if _under(e.source, KERNELS) and not _under(e.target, KERNELS)
          and e.target not in KERNEL_CONTRACT]


def _show(edges: list[Edge], indent: str = "  ") -> str:
  return "\n".join(f"{indent}{e.source} -> {e.target}  (line {e.line}"
                   f"{', in a function' * e.in_function}"
                   f"{', under TYPE_CHECKING' * e.type_checking})" for e in edges)


def _pairs(edges: list[Edge]) -> dict[tuple[str, str], bool]:
  """Each (source, target) once, with whether every one of its imports sits in a function."""
  out: dict[tuple[str, str], bool] = {}
  for e in edges:
    out[e.source, e.target] = out.get((e.source, e.target), True) and e.in_function
  return out


def report(every: list[Edge]) -> str:
  """The graph (one line per imported module), its circles and the rule violations, as text,
  from every import (`all_imports`)."""
  edges = [e for e in every if e.target == "maskc" or e.target.startswith("maskc.")]
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
                     ("the compiler imports Pallas or tokamax",
                      kernel_package_violations(every)),
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


@dataclasses.dataclass(frozen=True)
class PrivateUse:
  """A private name of one maskc module used by another.

  Attributes:
    source: the module that uses it.
    name: the dotted name used, e.g. `maskc.semantics.bind._int`.
    line: where.
  """
  source: str
  name: str
  line: int


def _is_private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def private_uses(root: pathlib.Path = ROOT) -> list[PrivateUse]:
  """Private names (`_x`, not dunders) of a maskc module used by another: imported (`from
  maskc.a import _x`, at any level, `TYPE_CHECKING` too) or read off an imported module
  (`from maskc import a` then `a._x`). A private module of the importer's own package is
  its own (`maskc/flax/__init__.py` may import `maskc.flax._attention`)."""
  files = module_files(root)
  known = set(files)
  out = set()
  for module, path in files.items():
    is_package = path.stem == "__init__"
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    modules: dict[str, str] = {}  # local name -> maskc module it is bound to
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        modules.update({a.asname: a.name for a in node.names
                        if a.asname and a.name in known})
      if not isinstance(node, ast.ImportFrom):
        continue
      base_name = _from_base(module, is_package, node)
      if not base_name.startswith("maskc"):
        continue
      for alias in node.names:
        full = f"{base_name}.{alias.name}"
        if full in known:
          modules[alias.asname or alias.name] = full
          if _is_private(alias.name) and base_name != package:
            out.add(PrivateUse(module, full, node.lineno))
        elif _is_private(alias.name) and base_name != module:
          out.add(PrivateUse(module, full, node.lineno))
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in modules and _is_private(node.attr)
          and modules[node.value.id] != module):
        out.add(PrivateUse(module, f"{modules[node.value.id]}.{node.attr}", node.lineno))
  return sorted(out, key=lambda u: (u.source, u.name, u.line))


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
  assert set(module_files()) >= {"maskc.lowering.closed_forms.band", "maskc.kernels.xla"}


def test_every_folder_of_the_package_is_a_package():
  """A folder without `__init__.py` would be a namespace package, which the wheel leaves out."""
  folders = {p.parent for p in (ROOT / "maskc").rglob("*.py")}
  bare = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
  assert not bare, f"folders without __init__.py: {bare}"


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


def test_the_compiler_imports_no_pallas_nor_tokamax():
  bad = kernel_package_violations(all_imports())
  assert not bad, "compiler modules import a kernel package:\n" + _show(bad)


def test_import_maskc_loads_no_pallas_nor_optional_packages():
  """What the rules above promise, measured: a fresh `import maskc` loads none of them."""
  code = ("import sys, maskc\n"
          "heavy = ('jax.experimental.pallas', 'jax._src.pallas', 'tokamax', 'torch', 'flax')\n"
          "print('\\n'.join(sorted(m for m in sys.modules\n"
          "                        if any(m == h or m.startswith(h + '.') for h in heavy))))")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=True)
  assert out.stdout.strip() == "", "import maskc loaded:\n" + out.stdout


def test_kernels_import_only_the_contract():
  bad = kernel_violations(import_graph())
  assert not bad, "kernels import compiler internals:\n" + _show(bad)


# Private names still read across modules, each to become public or to move (issue 46): the
# list only shrinks.
PRIVATE_USES_LEFT = {
    ("maskc.config.model", "maskc.language.parse._Program"),
    ("maskc.lowering.combined", "maskc.lowering.part_runs._AxisRuns"),
    ("maskc.lowering.combined", "maskc.lowering.range_analysis._decide_tiles"),
    ("maskc.lowering.combined", "maskc.lowering.range_analysis._pieces"),
    ("maskc.lowering.combined", "maskc.lowering.sampling._diagonal_pairs"),
    ("maskc.lowering.combined", "maskc.lowering.sampling._sampled_mixed"),
    ("maskc.lowering.part_rules", "maskc.lowering.combined._CombinedRuns"),
    ("maskc.lowering.part_rules", "maskc.lowering.part_runs._AxisRuns"),
    ("maskc.lowering.part_rules", "maskc.lowering.part_runs._EqualRuns"),
    ("maskc.lowering.part_rules", "maskc.lowering.part_runs._PeriodicRuns"),
    ("maskc.lowering.part_rules", "maskc.lowering.range_analysis._StaticRuns"),
    ("maskc.lowering.part_runs", "maskc.lowering.range_analysis._decided_leaves"),
    ("maskc.lowering.part_runs", "maskc.lowering.range_analysis._hold_leaves"),
    ("maskc.lowering.part_runs", "maskc.lowering.range_analysis._leaves_and_exactness"),
    ("maskc.lowering.part_runs", "maskc.lowering.sampling._RunReads"),
}


def test_no_private_name_is_used_across_modules():
  """What modules share is public: an interface, not another module's internals."""
  bad = [u for u in private_uses() if (u.source, u.name) not in PRIVATE_USES_LEFT]
  assert not bad, "private names used by another module (make them public, or move them):\n" \
      + "\n".join(f"  {u.source} uses {u.name} (line {u.line})" for u in bad)


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
  got = {(e.source, e.target, e.in_function, e.type_checking) for e in import_graph(root)}
  assert got == {
      ("maskc", "maskc.lowering.compile", False, False),
      ("maskc.attention", "maskc.kernels.api", True, False),
      ("maskc.lowering.compile", "maskc.lowering.static", False, False),
      ("maskc.lowering.compile", "maskc.tools", False, False),
      ("maskc.lowering.compile", "maskc", False, False),
      ("maskc.lowering.compile", "maskc.config", False, True),
      ("maskc.lowering.compile", "maskc.parallel", False, False),
      ("maskc.kernels", "maskc.kernels.api", False, False),
      ("maskc.kernels.api", "maskc.kernels.common", False, False),
      ("maskc.kernels.api", "maskc.lowering.static", False, False),
      ("maskc.kernels.api", "maskc.lowering.compile", True, False)}


def test_the_rules_catch_each_kind_of_violation(tmp_path):
  root = _write(tmp_path, {
      "maskc/__init__.py": "from maskc import attention\n",
      "maskc/attention.py": "def attention():\n  from maskc.kernels import api\n",
      "maskc/language/__init__.py": "", "maskc/language/errors.py": "",
      "maskc/language/ir.py": "from maskc.language.errors import E\n"
                              "def f():\n  from maskc.language import printer\n",
      "maskc/language/printer.py": "from maskc.language import ir\n",
      "maskc/semantics/__init__.py": "",
      "maskc/semantics/bind.py": "from maskc.lowering import x\n",
      "maskc/lowering/__init__.py": "", "maskc/lowering/x.py": "",
      "maskc/lowering/splash.py": "def f():\n  from maskc.kernels.common import x\n",
      "maskc/kernels/__init__.py": "",
      "maskc/kernels/common.py": "from maskc.compiled.blockmap import B\n",
      "maskc/kernels/api.py": "import maskc\nfrom maskc.language.errors import E\n",
      "maskc/compiled/__init__.py": "",
      "maskc/compiled/blockmap.py": "from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n  from maskc.compiled.info import I\n",
      "maskc/compiled/info.py": "from maskc.compiled.blockmap import B\n"
                                "from jax.experimental.pallas.ops import tpu\n",
      "maskc/grammar/__init__.py": ""})
  edges = import_graph(root)
  assert cycles(_cycle_edges(edges)) == [["maskc.compiled.blockmap", "maskc.compiled.info"],
                                         ["maskc.language.ir", "maskc.language.printer"]]
  assert [(e.source, e.target) for e in kernel_package_violations(all_imports(root))] == [
      ("maskc.compiled.info", "jax.experimental.pallas.ops")]
  assert [(e.source, e.target) for e in ir_violations(edges)] == [
      ("maskc.language.ir", "maskc.language.printer")]
  assert [(e.source, e.target) for e in compiler_to_kernel_violations(edges)] == [
      ("maskc.lowering.splash", "maskc.kernels.common")]
  assert [(e.source, e.target) for e in kernel_violations(edges)] == [
      ("maskc.kernels.api", "maskc")]
  assert {(e.source, e.target) for e in stage_violations(edges)} == {
      ("maskc.semantics.bind", "maskc.lowering.x"), ("maskc.kernels.api", "maskc"),
      ("maskc.lowering.splash", "maskc.kernels.common")}


def test_private_uses_finds_imports_and_reads_of_private_names(tmp_path):
  root = _write(tmp_path, {
      "maskc/__init__.py": "", "maskc/a/__init__.py": "from maskc.a import _impl\n",
      "maskc/a/_impl.py": "_x = 1\n",
      "maskc/a/one.py": "from maskc.a._impl import _x\nfrom maskc.b import two as t\n"
                        "y = t._hidden + t.shown\n",
      "maskc/b/__init__.py": "", "maskc/b/two.py": "from ..a import _impl\nfrom . import _own\n",
      "maskc/b/_own.py": ""})
  got = {(u.source, u.name) for u in private_uses(root)}
  assert got == {("maskc.a.one", "maskc.a._impl._x"), ("maskc.a.one", "maskc.b.two._hidden"),
                 ("maskc.b.two", "maskc.a._impl")}


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
  every = all_imports(pathlib.Path(args[0]) if args else ROOT)
  print(dot(import_graph(pathlib.Path(args[0]) if args else ROOT)) if "--dot" in sys.argv[1:]
        else report(every))
