"""Imports run one way (docs/development.md, "Layout"): a module imports only from the layers its own may use,
and no opsd modules import each other in a circle, whatever their layers.

    config <- data <- prompts <- sequences <- scoring <- teacher <- trainer <- train (the recipe)
    loss, device, answers: leaves (tensor math; where the process runs; answer matching), importable from any layer
    rewards (reward functions, advantages): config, data; imported by the recipe
    loss_kinds (the loss objects): config only, imported from scoring up
    models (modeling, tiny_models, convert_smollm2, smollm2_vlm, vl_processor, lora): config and prompts
    rollout: prompts and below, models; retention: rollout, prompts, sequences, scoring; evaluation: retention, rollout, prompts
    pipeline (prompts -> rollout -> sequences): sequences, rollout and below
    dumps: pipeline, scoring, teacher, rollout, evaluation, the checkpoint format, the quiet console; the recipe and CLIs: everything

Every `import`, including those inside functions, counts; nothing imports the recipe.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GROUPS = {  # group: module prefixes
    "config": ["opsd.config"],
    "loss": ["opsd.loss"],
    "answers": ["opsd.answers"],
    "rewards": ["opsd.rewards"],
    "loss_kinds": ["opsd.loss_kinds"],
    "device": ["opsd.device"],
    "data": ["opsd.data"],
    "prompts": ["opsd.prompts"],
    "sequences": ["opsd.sequences"],
    "models": ["opsd.modeling", "opsd.tiny_models", "opsd.convert_smollm2", "opsd.smollm2_vlm", "opsd.vl_processor",
               "opsd.lora"],
    "scoring": ["opsd.scoring"],
    "teacher": ["opsd.teacher"],
    "trainer": ["opsd.trainer"],
    "rollout": ["opsd.rollout"],
    "retention": ["opsd.retention"],
    "evaluation": ["opsd.evaluation"],
    "pipeline": ["opsd.pipeline"],
    "dumps": ["opsd.dumps", "opsd.rollouts"],
    "cli": ["opsd.export", "opsd.check", "opsd.evaluate"],
    "recipe": ["opsd.train"],
    "package": ["opsd"],
}
LEAVES = {"loss", "device", "answers", "package"}
MAY_IMPORT = {  # group: the groups (or module prefixes) it may import, besides itself and the leaves
    "config": set(),
    "loss": set(),
    "device": set(),
    "package": set(),
    "answers": set(),
    "data": {"config"},
    "rewards": {"config", "data"},
    "loss_kinds": {"config"},
    "prompts": {"config", "data"},
    "sequences": {"config", "data", "prompts"},
    "models": {"config", "data", "prompts"},
    "scoring": {"config", "data", "prompts", "sequences", "loss_kinds"},
    "teacher": {"config", "data", "prompts", "sequences", "scoring", "loss_kinds", "models"},  # models: LoRA adapter teachers
    "trainer": {"config", "data", "prompts", "sequences", "scoring", "loss_kinds", "teacher", "models"},
    "rollout": {"config", "data", "prompts", "models"},
    # The retention probe scores a text with the trainer's model, as scoring does; evaluation runs the probes.
    "retention": {"config", "data", "prompts", "rollout", "sequences", "scoring"},
    "evaluation": {"config", "data", "prompts", "rollout", "retention"},
    "pipeline": {"config", "data", "prompts", "sequences", "models", "rollout"},
    "dumps": {"config", "data", "prompts", "sequences", "scoring", "loss_kinds", "teacher", "models", "rollout",
              "evaluation", "pipeline", "opsd.trainer.checkpoint", "opsd.trainer.console"},
    "cli": set(GROUPS) - {"recipe"},
    "recipe": set(GROUPS) - {"recipe"},
}


def group_of(module: str) -> str:
    """The group of the longest matching prefix (`opsd.trainer.step` -> trainer)."""
    best = max(
        ((g, p) for g, prefixes in GROUPS.items() for p in prefixes if module == p or module.startswith(p + ".")),
        key=lambda gp: len(gp[1]),
    )
    return best[0]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def opsd_imports(source: str, module: str, *, is_package: bool = False, modules: frozenset[str] = frozenset()) -> list[str]:
    """Every opsd module `source` imports, at any depth, relative imports resolved (`is_package`: the
    source is the package's `__init__.py`). `from package import name` counts the module `package.name`
    when it is one of `modules` (or the package is `opsd`), else the package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(package + ([base] if base else []))
            # `from opsd import evaluation` imports a module: count the module, not the package.
            found += [f"{base}.{alias.name}" if base == "opsd" or f"{base}.{alias.name}" in modules else base
                      for alias in node.names]
    return [name for name in found if name == "opsd" or name.startswith("opsd.")]


def allowed(importer: str, imported: str) -> bool:
    source, target = group_of(importer), group_of(imported)
    if source == target or target in LEAVES:
        return True
    rules = MAY_IMPORT[source]
    return target in rules or any(imported == r or imported.startswith(r + ".") for r in rules)


def violations(root: Path) -> list[str]:
    """`importer -> imported` for every import of the `opsd` package under `root` that breaks the rule."""
    bad = []
    for path in sorted((root / "opsd").rglob("*.py")):
        importer = module_name(path, root)
        for imported in opsd_imports(path.read_text(), importer):
            if not allowed(importer, imported):
                bad.append(f"{importer} -> {imported}")
    return bad


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the opsd modules under `root` it imports (anywhere in its source), itself left out."""
    paths = {module_name(p, root): p for p in sorted((root / "opsd").rglob("*.py"))}
    modules = frozenset(paths)
    graph = {}
    for module, path in paths.items():
        imported = opsd_imports(path.read_text(), module, is_package=path.name == "__init__.py", modules=modules)
        graph[module] = {name for name in imported if name in modules} - {module}
    return graph


def cycles(root: Path) -> list[str]:
    """One circle `a -> b -> ... -> a` for each group of opsd modules under `root` that import each other
    in a circle (a strongly connected component of the import graph), whatever their layers."""
    graph = import_graph(root)

    def reachable(start: str) -> set[str]:
        reached, todo = set(), [start]
        while todo:
            new = graph[todo.pop()] - reached
            reached |= new
            todo += new
        return reached

    reach = {module: reachable(module) for module in graph}
    found, seen = [], set()
    for module in sorted(graph):
        if module in reach[module] and module not in seen:
            seen |= {m for m in reach[module] if module in reach[m]}
            found.append(" -> ".join(shortest_circle(graph, module)))
    return found


def shortest_circle(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest path of imports from `start` back to itself (breadth first)."""
    paths, todo = {start: [start]}, [start]
    while todo:
        current = todo.pop(0)
        for nxt in sorted(graph[current]):
            if nxt == start:
                return paths[current] + [start]
            if nxt not in paths:
                paths[nxt] = paths[current] + [nxt]
                todo.append(nxt)
    raise ValueError(f"{start} is on no circle")


def test_the_package_follows_the_dependency_rule():
    assert violations(ROOT) == []


def test_no_opsd_modules_import_each_other_in_a_circle():
    assert cycles(ROOT) == []


def test_every_module_has_a_group():
    modules = [module_name(p, ROOT) for p in (ROOT / "opsd").rglob("*.py")]
    assert all(group_of(m) != "package" for m in modules if m != "opsd")


@pytest.mark.parametrize(("path", "source", "expected"), [
    ("opsd/data/bad.py", "from opsd.sequences import encode_prompt\n", "opsd.data.bad -> opsd.sequences"),
    ("opsd/rollout/bad.py", "def f():\n    from opsd.trainer.step import train_step\n", "opsd.rollout.bad -> opsd.trainer.step"),
    ("opsd/scoring.py", "import opsd.trainer.fsdp\n", "opsd.scoring -> opsd.trainer.fsdp"),
    ("opsd/dumps/bad.py", "from opsd.train import train\n", "opsd.dumps.bad -> opsd.train"),
    ("opsd/dumps/bad.py", "from opsd.trainer.step import train_step\n", "opsd.dumps.bad -> opsd.trainer.step"),
    ("opsd/trainer/bad.py", "from ..rollout import make_engine\n", "opsd.trainer.bad -> opsd.rollout"),
    ("opsd/evaluation.py", "from opsd import train\n", "opsd.evaluation -> opsd.train"),
])
def test_a_lower_layer_importing_a_higher_one_is_reported(tmp_path, path, source, expected):
    file = tmp_path / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(source)
    assert violations(tmp_path) == [expected]


def test_allowed_imports_are_not_reported(tmp_path):
    (tmp_path / "opsd" / "dumps").mkdir(parents=True)
    (tmp_path / "opsd" / "dumps" / "ok.py").write_text(
        "from opsd.trainer.checkpoint import MODEL_DIR\nfrom opsd.scoring import ScoredBatch\nfrom opsd.loss import token_logprobs\n"
    )
    assert violations(tmp_path) == []


@pytest.mark.parametrize(("files", "expected"), [
    # The circle of the retention probe (main before issue 28): a function-level import closes it.
    ({"opsd/evaluation.py": "def build():\n    from opsd.retention import RetentionProbe\n",
      "opsd/retention.py": "from opsd.evaluation import generate_once\n"},
     ["opsd.evaluation -> opsd.retention -> opsd.evaluation"]),
    # Inside one layer, where the layer rule allows every import; `from package import module` counts the module.
    ({"opsd/trainer/__init__.py": "", "opsd/trainer/a.py": "from opsd.trainer import b\n",
      "opsd/trainer/b.py": "import opsd.trainer.c\n", "opsd/trainer/c.py": "from opsd.trainer.a import f\n"},
     ["opsd.trainer.a -> opsd.trainer.b -> opsd.trainer.c -> opsd.trainer.a"]),
    # A package and its module, through a relative import in the package's __init__.py; two circles, two lines.
    ({"opsd/rollout/__init__.py": "from .engine import Completion\n", "opsd/rollout/engine.py": "from opsd.rollout import x\n",
      "opsd/loss.py": "from opsd import device\n", "opsd/device.py": "import opsd.loss\n"},
     ["opsd.device -> opsd.loss -> opsd.device", "opsd.rollout -> opsd.rollout.engine -> opsd.rollout"]),
])
def test_any_circle_of_imports_is_reported(tmp_path, files, expected):
    for path, source in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    assert cycles(tmp_path) == expected


def test_imports_one_way_are_no_circle(tmp_path):
    (tmp_path / "opsd").mkdir()
    (tmp_path / "opsd" / "evaluation.py").write_text("from opsd.retention import RetentionProbe\nimport opsd.loss\n")
    (tmp_path / "opsd" / "retention.py").write_text("from opsd.loss import token_logprobs\n")
    (tmp_path / "opsd" / "loss.py").write_text("import torch\n")
    assert cycles(tmp_path) == []
