"""The docs (README.md and docs/*.md) name only what exists, and their examples run.

Checked in every page: `python -m MODULE` modules (found without importing them), `make` targets,
config keys (`section.key=value` overrides and `--config` files in commands, dotted `section.key`
in inline code, YAML snippets), repository paths, `opsd.module.name` references, relative links
and their `#anchors`; each training command writes to its own `logging.output_dir`.
Run: ```python snippets (each in its own temporary directory, `configs/` linked in) and
```console blocks (`--dry-run` / `--print` commands, in-process: each line shown must be printed).
Compiled, imports checked, not run: ```python no-run snippets (they start an engine or need a
run's output). `test_checks_catch_planted_errors` shows each check failing on a bad page.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import importlib
import importlib.machinery
import importlib.util
import re
import shlex
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml

from opsd.config import Config, ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = {f.name for f in dataclasses.fields(Config)}
REPO_DIRS = ("opsd", "configs", "tests", "bench", "scripts", "docs", ".ci")
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "parquet", "png", "pt", "safetensors", "txt", "log", "toml"}
CONFIG_COMMANDS = ("opsd.train", "opsd.dumps", "opsd.rollout.serve")
ARGUMENT_PARSERS = {"opsd.train": "opsd.train", "opsd.dumps": "opsd.dumps.__main__"}  # modules with parse_args(argv)
PLACEHOLDERS = {"/path/to/opsd": str(ROOT), "/path/to/python": sys.executable}


# ---------------------------------------------------------------- reading a page


@dataclasses.dataclass
class Block:
    info: str  # the fence's info string: "python", "python no-run", "yaml file=...", "console", ...
    body: str
    line: int  # of the first body line

    @property
    def lang(self) -> str:
        return self.info.split()[0] if self.info else ""


@dataclasses.dataclass
class Page:
    path: Path
    blocks: list[Block]
    prose: list[tuple[int, str]]  # (line number, text) outside fences

    @classmethod
    def read(cls, path: Path) -> "Page":
        text = path.read_text()
        blocks, prose, fence = [], [], None
        for number, line in enumerate(text.split("\n"), 1):
            if fence is None:
                match = re.match(r"\s*(`{3,})(.*)$", line)
                if match:
                    fence, info, body, start = match.group(1), match.group(2).strip(), [], number + 1
                else:
                    prose.append((number, line))
            elif re.fullmatch(rf"\s*{fence}`*\s*", line):
                blocks.append(Block(info, "\n".join(body), start))
                fence = None
            else:
                body.append(line)
        return cls(path, blocks, prose)

    def where(self, line: int) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name}:{line}"

    def inline_code(self) -> list[tuple[int, str]]:
        return [(n, m.group(2).strip()) for n, line in self.prose
                for m in re.finditer(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", line)]

    def links(self) -> list[tuple[int, str]]:
        links = []
        for n, line in self.prose:
            line = re.sub(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", "", line)
            links += [(n, m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)\)", line)]
        return links

    def anchors(self) -> set[str]:
        """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
        seen, anchors = {}, set()
        for _, line in self.prose:
            match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if match:
                slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
                anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
                seen[slug] = seen.get(slug, 0) + 1
        return anchors

    def commands(self) -> list[tuple[int, list[str], bool]]:
        """Shell commands of bash/sh blocks (continuation lines joined) and of inline `python ...`,
        `torchrun ...` and `make ...` code, as (line, argv, whether it is a whole command line: in
        prose, `python -m opsd.train` may name the command without its arguments)."""
        found = []
        for block in self.blocks:
            if block.lang not in ("bash", "sh", "shell"):
                continue
            pending, start = "", None
            for i, line in enumerate(block.body.split("\n")):
                start = block.line + i if not pending else start
                pending += line[:-1] + " " if line.endswith("\\") else line
                if not line.endswith("\\"):
                    found.append((start, pending, True))
                    pending = ""
        found += [(n, code, False) for n, code in self.inline_code() if re.match(r"(python|make|torchrun)\s", code)]
        commands = []
        for n, line, whole in found:
            try:
                argv = shlex.split(line, comments=True)
            except ValueError:
                argv = line.split()
            if argv:
                commands.append((n, argv, whole))
        return commands


# ---------------------------------------------------------------- what exists


def module_spec(name: str):
    """The spec of a module, found without importing it or its packages."""
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0]) if parts[0] else None
    for depth in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: depth + 1]), spec.submodule_search_locations)
    return spec


def defines(module: str, name: str) -> bool:
    """`module` (a file of this repository or of site-packages) defines or imports `name` at top
    level, or has a submodule of that name; read from its source, not imported."""
    spec = module_spec(module)
    if spec is None:
        return False
    if module_spec(f"{module}.{name}") is not None:
        return True
    if not spec.origin or not spec.origin.endswith(".py"):
        return False
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return name in names


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*:", (ROOT / "Makefile").read_text(), flags=re.M))


def _candidates(tp) -> list:
    """The types a field may hold: Annotated, Optional and unions unwrapped."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _candidates(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(tp) for c in _candidates(arg)]
    return [tp]


def key_type(parts: list[str], tp=Config):
    """The types `a.b.c` may hold in the config dataclasses; empty when no such key exists. A key of
    any member of a union (the loss kinds, say) counts."""
    types = [tp]
    for part in parts:
        found = []
        for tp in (c for t in types for c in _candidates(t)):
            origin = typing.get_origin(tp)
            if dataclasses.is_dataclass(tp):
                hints = typing.get_type_hints(tp, include_extras=True)
                if part in {f.name for f in dataclasses.fields(tp)}:
                    found.append(hints[part])
            elif origin in (list, tuple) and part.isdigit():
                found.append(typing.get_args(tp)[0])
            elif origin is dict:
                key, value = typing.get_args(tp)
                if typing.get_origin(key) is not typing.Literal or part in typing.get_args(key):
                    found.append(value)
        if not found:
            return []
        types = found
    return types


def yaml_keys(node, prefix: list[str]) -> list[list[str]]:
    """Every key path of a YAML snippet, descending into sections, lists of sections and maps."""
    paths = []
    if isinstance(node, dict):
        for key, value in node.items():
            path = [*prefix, str(key)]
            paths.append(path)
            if any(dataclasses.is_dataclass(c) or typing.get_origin(c) in (dict, list) for t in key_type(path) for c in _candidates(t)):
                paths += yaml_keys(value, path)
    elif isinstance(node, list):
        for index, item in enumerate(node):
            paths += yaml_keys(item, [*prefix, str(index)])
    return paths


def merged(base: dict, snippet: dict) -> dict:
    """`snippet` over `base`, section by section; data.datasets replaces data.path."""
    out = {**base}
    for key, value in snippet.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    if "datasets" in snippet.get("data", {}):
        out["data"].pop("path", None)
    return out


def is_subset(part, whole) -> bool:
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and is_subset(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and len(part) == len(whole) and all(map(is_subset, part, whole))
    return part == whole


# ---------------------------------------------------------------- the checks


def module_of(argv: list[str]) -> str | None:
    """The `-m` module of a python or torchrun command (the first -m: later ones are pytest's)."""
    runner = next((i for i, a in enumerate(argv) if Path(a).name in ("python", "python3", "torchrun")), None)
    if runner is None or "-m" not in argv[runner:]:
        return None
    index = argv.index("-m", runner)
    return argv[index + 1] if index + 1 < len(argv) else ""


def overrides_of(argv: list[str]) -> list[str]:
    return [a for a in argv if re.match(r"[a-z_]+(\.[A-Za-z0-9_]+)+=", a)]


def check_commands(page: Page, runs: dict) -> list[str]:
    problems, targets = [], make_targets()
    for n, argv, whole in page.commands():
        where = page.where(n)
        if argv[0] == "make":
            problems += [f"{where}: make target {t!r} is not in the Makefile" for t in argv[1:] if t not in targets]
            continue
        module = module_of(argv)
        if module and module_spec(module) is None:
            problems.append(f"{where}: python -m {module}: no such module")
        if module in ARGUMENT_PARSERS and whole:
            parse_args = importlib.import_module(ARGUMENT_PARSERS[module]).parse_args
            try:
                with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
                    parse_args(argv[argv.index(module) + 1 :])
            except SystemExit as exit:
                if exit.code:
                        problems.append(f"{where}: python -m {module} rejects its arguments: {err.getvalue().strip()}")
        opsd_command = bool(module and module.startswith("opsd")) or any(a.startswith("bench/") for a in argv)
        for item in overrides_of(argv):
            key = item.split("=", 1)[0].split(".")
            if (opsd_command or key[0] in SECTIONS) and not key_type(key):
                problems.append(f"{where}: config key {'.'.join(key)!r} does not exist (opsd/config.py)")
        if "--config" in argv and argv.index("--config") + 1 < len(argv):
            config = argv[argv.index("--config") + 1]
            if not (ROOT / config).is_file():
                problems.append(f"{where}: --config {config}: no such file")
            elif module in CONFIG_COMMANDS:
                try:
                    cfg = load_config(ROOT / config, overrides_of(argv))
                except ConfigError as err:
                    problems.append(f"{where}: {' '.join(argv)}: {err}")
                    continue
                trains = module == "opsd.train" and not {"--dry-run", "--check", "--help"} & set(argv)
                if trains and "checkpoint.resume_from=auto" not in argv:
                    runs.setdefault(cfg.logging.output_dir, set()).add((where, " ".join(argv)))
    return problems


def check_inline_names(page: Page) -> list[str]:
    problems = []
    for n, code in page.inline_code():
        where = page.where(n)
        key = re.match(r"([a-z_]+(?:\.[A-Za-z0-9_]+)+)(?=$|[=:\s])", code)
        if key and key.group(1).split(".")[0] in SECTIONS and key.group(1).split(".")[-1] not in FILE_SUFFIXES:
            if not key_type(key.group(1).split(".")):
                problems.append(f"{where}: config key {key.group(1)!r} does not exist (opsd/config.py)")
        name = re.match(r"(opsd(?:\.[A-Za-z_]\w*)+)(?=$|[\s(:])", code)
        if name:
            parts = name.group(1).split(".")
            depth = max(i for i in range(1, len(parts) + 1) if module_spec(".".join(parts[:i])) is not None)
            if depth < len(parts) and not defines(".".join(parts[:depth]), parts[depth]):
                problems.append(f"{where}: {name.group(1)}: {'.'.join(parts[:depth])} has no {parts[depth]!r}")
    return problems


def repo_paths(page: Page) -> list[tuple[int, str]]:
    tokens = [(n, code) for n, code in page.inline_code()]
    tokens += [(n, a) for n, argv, _ in page.commands() for a in argv]
    paths = []
    for n, token in tokens:
        token = token.split()[0] if token.split() else token
        top = token.split("/")[0]
        if (top in REPO_DIRS and "/" in token) or token in ("Makefile", "pyproject.toml", "README.md"):
            if not re.search(r"[{}<>*…]|\.\.\.", token):
                paths.append((n, token.rstrip(".,;:)")))
    return paths


def check_paths_and_links(page: Page, pages: dict[Path, Page]) -> list[str]:
    problems = [f"{page.where(n)}: {p}: no such file or directory" for n, p in repo_paths(page) if not (ROOT / p).exists()]
    for n, target in page.links():
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.path.parent / path).resolve() if path else page.path
        if not file.exists():
            problems.append(f"{page.where(n)}: link {target}: no such file")
        elif anchor:
            linked = pages.get(file) or Page.read(file)
            if anchor not in linked.anchors():
                problems.append(f"{page.where(n)}: link {target}: no heading #{anchor} in {file.name}")
    return problems


def check_yaml(page: Page) -> list[str]:
    problems = []
    for block in (b for b in page.blocks if b.lang in ("yaml", "yml")):
        where = page.where(block.line)
        snippet = yaml.safe_load(block.body)
        problems += [f"{where}: YAML key {'.'.join(p)!r} does not exist (opsd/config.py)"
                     for p in yaml_keys(snippet, []) if not key_type(p)]
        try:  # the values too: the snippet over a minimal config (a data path, a model path)
            config_from_dict(merged({"model": {"path": "m"}, "data": {"path": "d"}}, snippet))
        except ConfigError as err:
            problems.append(f"{where}: the snippet does not load: {err}")
        source = re.search(r"file=(\S+)", block.info)
        if source and not is_subset(snippet, yaml.safe_load((ROOT / source.group(1)).read_text())):
            problems.append(f"{where}: the snippet differs from {source.group(1)}")
    return problems


def check_no_run_snippet(page: Page, block: Block) -> list[str]:
    where = page.where(block.line)
    try:
        tree = ast.parse(block.body)
    except SyntaxError as err:
        return [f"{where}: snippet does not compile: {err}"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            problems += [f"{where}: import {a.name}: no such module" for a in node.names if module_spec(a.name) is None]
        elif isinstance(node, ast.ImportFrom):
            if module_spec(node.module) is None:
                problems.append(f"{where}: from {node.module}: no such module")
            else:
                problems += [f"{where}: {node.module} has no {a.name!r}" for a in node.names if not defines(node.module, a.name)]
    return problems


def blocks_to_run(lang: str) -> list[tuple[Page, Block]]:
    """The ```python snippets not marked no-run, or the ```console blocks, of every page."""
    return [(page, b) for page in map(Page.read, PAGES) for b in page.blocks
            if b.lang == lang and "no-run" not in b.info.split()]


def all_problems(pages: list[Page]) -> list[str]:
    by_path = {p.path: p for p in pages}
    problems, runs = [], {}
    for page in pages:
        problems += check_commands(page, runs)
        problems += check_inline_names(page)
        problems += check_paths_and_links(page, by_path)
        problems += check_yaml(page)
        problems += [p for b in page.blocks if b.lang == "python" and "no-run" in b.info.split()
                     for p in check_no_run_snippet(page, b)]
    for output_dir, commands in runs.items():
        if len({c for _, c in commands}) > 1:
            listed = "; ".join(f"{w}: {c}" for w, c in sorted(commands))
            problems.append(f"logging.output_dir {output_dir} is shared by several training examples: {listed}")
    return problems


# ---------------------------------------------------------------- the tests


def test_docs_name_only_what_exists():
    problems = all_problems([Page.read(p) for p in PAGES])
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_page_linking_every_docs_page():
    readme = Page.read(ROOT / "README.md")
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in readme.links()}
    assert not [p.name for p in PAGES[1:] if p not in linked], "docs pages the README does not link"
    first = [argv for _, argv, _ in readme.commands()][:2]
    assert first == [["make", "demo"], ["make", "test"]], "the README's first commands are `make demo` and `make test`"


def params(found: list[tuple[Page, Block]]) -> list:
    return [pytest.param(page, block, id=page.where(block.line)) for page, block in found]


@pytest.mark.parametrize("page,block", params(blocks_to_run("python")))
def test_python_snippet_runs(page, block, tmp_path, monkeypatch):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    code = compile(block.body, page.where(block.line), "exec")
    exec(code, {"__name__": "__docs__"})


@pytest.mark.parametrize("page,block", params(blocks_to_run("console")))
def test_console_block_shows_what_the_command_prints(page, block, capsys, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(ROOT)
    text = re.sub(r"\s*\\\n\s*", " ", block.body)
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    chunks = re.split(r"^\$ ", text, flags=re.M)[1:]
    assert chunks, f"{page.where(block.line)}: a console block starts with `$ command`"
    for chunk in chunks:
        command, *shown = chunk.rstrip().split("\n")
        argv = shlex.split(command)
        module = module_of(argv)
        if module == "opsd.rollout.serve" and "--print" in argv:
            import torch

            if torch.cuda.is_available():
                pytest.skip("the docs show the CPU server command (CPU-only flags)")
            from opsd.rollout.serve import main
        elif module == "opsd.train" and "--dry-run" in argv:
            from opsd.train import main
        else:
            pytest.fail(f"{page.where(block.line)}: console blocks run only `opsd.train --dry-run` and "
                        f"`opsd.rollout.serve --print` commands; mark others as plain text")
        capsys.readouterr()
        with contextlib.suppress(SystemExit):
            main(argv[argv.index(module) + 1 :])
        printed = capsys.readouterr()
        lines = {line.rstrip() for line in (printed.out + printed.err).splitlines()}
        missing = [line for line in shown if line.rstrip() not in lines]
        assert not missing, f"{page.where(block.line)}: lines the command did not print:\n" + "\n".join(missing)


def test_checks_catch_planted_errors(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text("""# Bad page

```bash
python -m opsd.trian --config configs/smoke.yaml
python -m opsd.train --config configs/smoke.yaml rollout.temprature=1.0 logging.output_dir=runs/y
python -m opsd.train --config configs/smoke.yaml logging.output_dir=runs/x train.max_steps=3
python -m opsd.train --config configs/smoke.yaml logging.output_dir=runs/x train.max_steps=4
python -m opsd.train --config configs/no-such.yaml
python -m opsd.dumps dump --config configs/smoke.yaml
make demoo
```

Set `loss.betta` and read `opsd/no_such_file.py`, or call `opsd.scoring.no_such_function`.
See [training](docs/no-such-page.md) and [one step](README.md#no-such-heading).

```yaml
rollout:
  sync_bucket_gb: 1
loss:
  beta: 1.5
```

```python no-run
from opsd.loss import no_such_loss
```
""")
    (tmp_path / "README.md").write_text("# Readme\n")
    problems = "\n".join(all_problems([Page.read(bad)]))
    for expected in [
        "python -m opsd.trian: no such module",
        "config key 'rollout.temprature' does not exist",
        "logging.output_dir runs/x is shared by several training examples",
        "--config configs/no-such.yaml: no such file",
        "make target 'demoo' is not in the Makefile",
        "python -m opsd.dumps rejects its arguments",
        "config key 'loss.betta' does not exist",
        "opsd/no_such_file.py: no such file or directory",
        "opsd.scoring has no 'no_such_function'",
        "link docs/no-such-page.md: no such file",
        "link README.md#no-such-heading: no heading #no-such-heading",
        "YAML key 'rollout.sync_bucket_gb' does not exist",
        "loss.beta: Input should be less than or equal to 1",
        "opsd.loss has no 'no_such_loss'",
    ]:
        assert expected in problems, f"not caught: {expected}\n{problems}"
