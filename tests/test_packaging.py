"""covey as a user installs it: the wheel and the sdist, built here with the project's own build backend,
carry every file of the package, among them every file a module reads next to itself at run time.
(tests/wheel_install.sh installs the wheel in a fresh environment and trains with it.)"""

import ast
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import covey

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "covey"
DEV_ONLY = ("pytest", "hypothesis", "trl", "tensorboard", "wandb", "trackio", "mlflow", "openenv", "bitsandbytes",
            "math-verify")


def package_files(root: Path = PACKAGE) -> set[str]:
    """The package's files as the wheel names them (covey/...), without compiled bytecode."""
    return {"covey/" + p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def files_read_at_run_time(root: Path = PACKAGE) -> set[str]:
    """Each file a module names as a neighbour of its own file or inside a package's resources:
    ``Path(__file__).with_name("x")``, ``Path(__file__).parent / "x"``, ``importlib.resources.files(...) / "x"``."""
    found = set()
    for module in root.rglob("*.py"):
        folder = "covey/" + module.parent.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "with_name" \
                    and "__file__" in ast.unparse(node.func.value) and isinstance(node.args[0], ast.Constant):
                found.add(f"{folder}/{node.args[0].value}")
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                    and re.search(r"__file__\)\.parent$|resources\.files\(", ast.unparse(node.left)):
                found.add(f"{folder}/{node.right.value}")
    return {path.replace("covey/.", "covey") for path in found}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel and the sdist of a copy of the project (the build writes its scratch folders beside it)."""
    tree = tmp_path_factory.mktemp("project")
    shutil.copy(ROOT / "pyproject.toml", tree)
    shutil.copy(ROOT / "README.md", tree)
    shutil.copytree(PACKAGE, tree / "src" / "covey", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tree / "dist"
    script = ("import sys; from setuptools import build_meta as backend; "
              "out = sys.argv[1]; names = backend.build_wheel(out), backend.build_sdist(out); print('built', *names)")
    done = subprocess.run([sys.executable, "-c", script, str(out)], cwd=tree, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel, sdist = done.stdout.splitlines()[-1].split()[1:]
    return out / wheel, out / sdist


def test_the_scan_finds_the_files_modules_read_next_to_themselves():
    found = files_read_at_run_time()
    assert {"covey/rollout/fast/decode_kernel.c", "covey/rewards/sandbox_boot.py"} <= found
    assert found <= package_files(), f"read at run time but not in the package: {found - package_files()}"


def test_the_wheel_carries_every_file_of_the_package(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"covey-{covey.__version__}.dist-info/METADATA").decode()
        entry_points = archive.read(f"covey-{covey.__version__}.dist-info/entry_points.txt").decode()
    assert wheel.name == f"covey-{covey.__version__}-py3-none-any.whl"
    missing = package_files() - names
    assert not missing, f"left out of the wheel: {sorted(missing)}"
    assert files_read_at_run_time() <= names
    assert re.search(r"^covey = covey\.cli:main$", entry_points, re.M)
    # what a plain `pip install covey` brings: no test tool, tracker or optional integration
    required = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    base = [r for r in required if "extra ==" not in r]
    assert any(r.startswith("torch") for r in base) and any(r.startswith("transformers") for r in base)
    assert not [r for r in base if re.split(r"[<>=!~ \[;]", r)[0].lower() in DEV_ONLY], base


def test_the_sdist_carries_every_file_of_the_package(built):
    _, sdist = built
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as archive:
        raw = set(archive.getnames())
    assert {f"{top}/pyproject.toml", f"{top}/README.md"} <= raw
    names = {name.removeprefix(f"{top}/src/") for name in raw}
    missing = package_files() - names
    assert not missing, f"left out of the sdist: {sorted(missing)}"
