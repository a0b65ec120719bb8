"""The README's Quick start: the two commands, CI running the test command verbatim, one way
to install DeepSpeed, and the one-line message when a source folder shadows the package."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
PYPROJECT = ROOT / "pyproject.toml"

VENV = "python3 -m venv .venv && . .venv/bin/activate && "
CPU_TORCH = "pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu"
DEEPSPEED = ("pip install --no-deps deepspeed==0.19.8 && pip install hjson msgpack einops "
             "py-cpuinfo psutil pydantic packaging tqdm ninja")


def _quick_start() -> list[str]:
    """The one-line ```sh blocks of the README's Quick start section, in order."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```sh\n(.*?)```", section, re.S)]


pytestmark = pytest.mark.skipif(not README.is_file(), reason="no README.md beside the tests")


def test_two_commands_make_a_venv_and_name_the_cpu_index() -> None:
    bench, tests = _quick_start()
    for cmd in (bench, tests):
        assert "\n" not in cmd
        assert cmd.startswith(VENV + CPU_TORCH + " && "), cmd
    assert bench.endswith("pip install -e . && aioswap bench")
    assert tests.endswith('pip install -e ".[test]" && python -m pytest -q')


@pytest.mark.skipif(not CI.is_file(), reason="no .ci/run beside the tests")
def test_ci_runs_the_readme_test_command_verbatim() -> None:
    tests = _quick_start()[1]
    lines = [ln.strip() for ln in CI.read_text(encoding="utf-8").splitlines()]
    assert tests in lines
    # everything else CI installs goes into the same venv, before the test command
    assert lines.index("python3 -m venv .venv") < lines.index(tests)
    assert lines.index(". .venv/bin/activate") < lines.index(tests)


@pytest.mark.skipif(not (CI.parent / "as_normal_user").is_file(),
                    reason="no .ci/as_normal_user beside the tests")
def test_ci_runs_the_readme_test_command_as_a_normal_user_too() -> None:
    tests = _quick_start()[1]
    script = (CI.parent / "as_normal_user").read_text(encoding="utf-8")
    assert f"&& {tests}'" in script            # verbatim, after the cd into its clone
    assert "--inh-caps=-ipc_lock" in script and "--memlock=8388608" in script
    lines = [ln.strip() for ln in CI.read_text(encoding="utf-8").splitlines()]
    assert lines.index("bash .ci/as_normal_user") > lines.index(tests)


def test_one_deepspeed_install_instruction() -> None:
    texts = {p.name: p.read_text(encoding="utf-8") for p in (README, CI, PYPROJECT)
             if p.is_file()}
    for name, text in texts.items():
        mentions = [ln for ln in text.splitlines()
                    if any(tok.lower().startswith("deepspeed") or "[deepspeed" in tok.lower()
                           for args in re.findall(r"pip install([^`&#\n]*)", ln)
                           for tok in args.split())]
        assert mentions, f"{name} does not say how to install DeepSpeed"
        for ln in mentions:
            assert DEEPSPEED in ln, f"{name}: {ln.strip()!r} is another way to install DeepSpeed"


def test_shadowing_source_folder_is_one_line(tmp_path: Path) -> None:
    """``python -m aioswap`` run beside a folder named aioswap that has no __init__.py."""
    if not (ROOT / "aioswap" / "__init__.py").is_file():
        pytest.skip("no source tree beside the tests")
    (tmp_path / "aioswap").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [sys.executable, "-c", "import aioswap; print(getattr(aioswap, '__file__', None))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    shadowed = probe.stdout.strip() == "None"
    r = subprocess.run([sys.executable, "-m", "aioswap", "--version"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    if not shadowed:        # a regular install wins over the namespace folder: nothing to say
        assert r.returncode == 0, r.stderr
        return
    if r.returncode != 2 and "No module named aioswap.__main__" in r.stderr:
        pytest.skip("this install cannot load aioswap.__main__ through the shadowing folder")
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("aioswap: error: "), r.stderr
    assert str(tmp_path / "aioswap") in lines[0]
