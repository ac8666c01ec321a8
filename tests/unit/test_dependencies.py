"""Imports run one way (docs/development.md, "Layout"): a module imports only from the layers its own may use.

    config <- data <- prompts <- sequences <- scoring <- teacher <- trainer <- train (the recipe)
    loss, device: leaves (tensor math; where the process runs), importable from any layer
    loss_kinds (the loss objects): config only, imported from scoring up
    models (modeling, tiny_models, convert_smollm2, smollm2_vlm, vl_processor, lora): config and prompts
    rollout: prompts and below, models; evaluation (and retention): rollout, prompts, sequences, scoring
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
    "evaluation": ["opsd.evaluation", "opsd.retention"],
    "pipeline": ["opsd.pipeline"],
    "dumps": ["opsd.dumps", "opsd.rollouts"],
    "cli": ["opsd.export", "opsd.check", "opsd.evaluate"],
    "recipe": ["opsd.train"],
    "package": ["opsd"],
}
LEAVES = {"loss", "device", "package"}
MAY_IMPORT = {  # group: the groups (or module prefixes) it may import, besides itself and the leaves
    "config": set(),
    "loss": set(),
    "device": set(),
    "package": set(),
    "data": {"config"},
    "loss_kinds": {"config"},
    "prompts": {"config", "data"},
    "sequences": {"config", "data", "prompts"},
    "models": {"config", "data", "prompts"},
    "scoring": {"config", "data", "prompts", "sequences", "loss_kinds"},
    "teacher": {"config", "data", "prompts", "sequences", "scoring", "loss_kinds", "models"},  # models: LoRA adapter teachers
    "trainer": {"config", "data", "prompts", "sequences", "scoring", "loss_kinds", "teacher", "models"},
    "rollout": {"config", "data", "prompts", "models"},
    # The retention probe scores a text with the trainer's model, as scoring does.
    "evaluation": {"config", "data", "prompts", "rollout", "sequences", "scoring"},
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


def opsd_imports(source: str, module: str) -> list[str]:
    """Every opsd module `source` imports, at any depth, relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level]
                base = ".".join(package + ([base] if base else []))
            # `from opsd import evaluation` imports a module: count the module, not the package.
            found += [f"{base}.{alias.name}" if base == "opsd" else base for alias in node.names]
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


def test_the_package_follows_the_dependency_rule():
    assert violations(ROOT) == []


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
