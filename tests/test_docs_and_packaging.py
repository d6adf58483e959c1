"""The README, docs/, --help and the installed package agree with the code."""

import os
import re
import subprocess
import sys

from nimble.plan.document import SCHEMA_VERSION
from nimble.ops.allowlist import SUPPORTED, TRAINING_ONLY

from .conftest import ROOT

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def test_the_supported_ops_page_lists_every_supported_op_and_nothing_else():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_docs.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr  # generated from the allowlist, and up to date
    section = (DOCS / "supported-ops.md").read_text()
    for group, names in SUPPORTED.items():
        line = next(line for line in section.splitlines() if line.startswith(f"- **{group}**"))
        assert re.findall(r"`([^`]+)`", line) == list(names), group
    listed = re.findall(r"^- \*\*(.+?)\*\*", section, re.M)
    assert listed == list(SUPPORTED)
    training = next(line for line in section.splitlines() if line.startswith("Training only"))
    assert re.findall(r"`([^`]+)`", training)[1:] == list(TRAINING_ONLY)  # [0] is prepare(...)


def test_readme_has_exactly_two_setup_commands():
    setup = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", setup, re.S)
    assert commands == [
        "pip install -e . && nimble compile sample_models/inception.pt --shape 1x3x224x224",
        "pip install -e '.[test]' && pytest -n 2 --dist loadfile",
    ]


def test_readme_documents_the_plan_document_fields():
    from nimble.plan.document import plan_document
    from nimble.ir import Graph

    doc = plan_document(Graph((), (), (), ()), model="m")
    table = (DOCS / "plan-document.md").read_text()
    for key in doc:
        assert f"`{key}`" in table, key
    assert f"| `schema_version` | {SCHEMA_VERSION} |" in table
    for key in ("id", "target", "inputs", "deps", "stream", "order", "waits", "source", "outputs"):
        assert key in table
    for key in ("value", "shape", "dtype", "nbytes", "offset", "alias_of"):
        assert key in table


def test_the_layout_table_matches_the_folders():
    table = (DOCS / "layout.md").read_text().split("\n\n", 2)[1]
    rows = dict(re.findall(r"^\| `(core/[\w/]*)` \| [^|]+ \| (.+) \|$", table, re.M))
    core = ROOT / "core"
    folders = {f"core/{p.parent.relative_to(core)}/".replace("core/./", "core/") for p in core.rglob("__init__.py")}
    assert set(rows) == folders
    for folder, text in rows.items():
        listed = set(re.findall(r"`(\w+\.py)`", text))
        present = {p.name for p in (ROOT / folder).glob("*.py")} - {"__init__.py"}
        assert listed == present, folder


def test_the_readme_is_short_and_every_link_resolves():
    assert len(README.encode()) < 30_000
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which is missing"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", README))
    assert linked == {f"docs/{p.name}" for p in DOCS.glob("*.md")}  # every page is reachable from the README


def test_every_design_citation_in_the_code_names_a_section_of_design_md():
    sections = set(re.findall(r"^## (.+)$", (ROOT / "DESIGN.md").read_text(), re.M))
    cited = {}
    for folder in ("core", "formats", "nimble_cli", "tests", "benchmarks", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in re.findall(r'DESIGN\.md, "([^"]+)"', path.read_text()):
                cited[name] = path.relative_to(ROOT)
    assert cited and all(name in sections for name in cited), {n: str(p) for n, p in cited.items() if n not in sections}


def test_installed_package_has_no_generic_top_level_modules(tmp_path):
    code = ("import importlib.util as u, nimble, nimble.formats, nimble.cli; "
            "print(u.find_spec('core'), u.find_spec('formats'), u.find_spec('nimble_cli'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "None", "None"]


def test_a_built_wheel_holds_every_module(tmp_path):
    """A wheel (what `pip install .` and pipelines install) carries every module of the tree under
    its import name; `pip install -e .` would hide a missing package."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    wheel, = tmp_path.glob("*.whl")
    held = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    want = set()
    for name, folder in {"nimble": "core", "nimble/formats": "formats", "nimble/cli": "nimble_cli"}.items():
        want |= {f"{name}/{p.relative_to(ROOT / folder).as_posix()}" for p in (ROOT / folder).rglob("*.py")}
    assert want and want <= held, sorted(want - held)[:5]


def test_console_script_is_installed(tmp_path):
    out = subprocess.run(["nimble", "--version"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("nimble ")


def test_the_gpu_test_runner_runs_every_gpu_test_file_once():
    """`.ci/gpu-tests` deals the files that hold GPU tests out to its processes: each exactly
    once, however many processes, so a new GPU test file is never left out."""
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                    if "pytest.mark.gpu" in p.read_text())
    assert len(marked) > 10
    for processes in (1, 3, 5, 8):
        listed = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-tests"), "--list", str(processes)],
                                capture_output=True, text=True, check=True).stdout.splitlines()
        assert len(listed) == processes
        files = [f for line in listed for f in line.split()]
        assert sorted(files) == marked
    halves = []
    for chosen in ("0 2 4 6", "1 3 5 7"):  # two device calls split the suite with GPU_TEST_SHARDS
        listed = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-tests"), "--list", "8"], capture_output=True,
                                text=True, check=True, env={**os.environ, "GPU_TEST_SHARDS": chosen}).stdout.split()
        halves.append(listed)
    assert sorted(halves[0] + halves[1]) == marked and halves[0] and halves[1]
    bad = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-tests"), "--list", "4"], capture_output=True, text=True,
                         env={**os.environ, "GPU_TEST_SHARDS": "5"})
    assert bad.returncode == 2 and "processes 0 to 3" in bad.stderr


def test_import_nimble_works_beside_a_clone_named_nimble(tmp_path):
    """Python started in the folder that holds a clone named `nimble` (no __init__.py at its top)
    imports the installed nimble, not the clone's folder as an empty namespace package."""
    for folder in ("core", "formats", "nimble_cli", "tests"):
        (tmp_path / "nimble" / folder).mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", "import nimble; print(nimble.Nimble.__name__, nimble.__version__)"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[0] == "Nimble", done.stderr[-2000:]
