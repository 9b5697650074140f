"""dlinfer/envs.py is the one list of DLINFER_* settings: every name the package mentions is in it,
no module reads one from os.environ directly, docs/settings.md lists exactly these, and `env`
prints them with their effective values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dlinfer import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dlinfer"
NAME = re.compile(r"\bDLINFER_[A-Z0-9_]*[A-Z0-9]\b")
# identifiers that look like settings but are Python names (a device spec, a tuple of device types)
NOT_SETTINGS = {"DLINFER_CUDA", "DLINFER_DEVICE_TYPES"}


def test_every_name_the_package_mentions_is_a_setting():
    mentioned = {}  # name -> the files besides envs.py that mention it
    for path in PACKAGE.rglob("*.py"):
        if path.name == "envs.py" and path.parent == PACKAGE:
            continue
        for name in NAME.findall(path.read_text()):
            mentioned.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    missing = {n: sorted(p) for n, p in mentioned.items() if n not in envs.BY_NAME and n not in NOT_SETTINGS}
    assert not missing, f"DLINFER_* names missing from dlinfer/envs.py: {missing}"
    unused = sorted(set(envs.BY_NAME) - set(mentioned))
    assert not unused, f"settings in dlinfer/envs.py that no module reads: {unused}"


def test_no_module_reads_a_setting_from_the_environment_directly():
    direct = re.compile(r"environ(?:\.get)?[\[(]\s*[\"']DLINFER_|getenv\(\s*[\"']DLINFER_")
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                 if p.name != "envs.py" and direct.search(p.read_text())]
    assert not offenders, offenders


def test_the_docs_list_exactly_the_settings():
    listed = re.findall(r"^\| `(DLINFER_[A-Z0-9_]+)` \|", (ROOT / "docs" / "settings.md").read_text(), re.M)
    assert listed == [s.name for s in envs.SETTINGS]


def test_get_strips_and_treats_blank_as_unset():
    env = {"DLINFER_VENDOR": "  cpu ", "DLINFER_KV_LAYOUT": "   "}
    assert envs.get("DLINFER_VENDOR", env) == "cpu"
    assert envs.get("DLINFER_KV_LAYOUT", env) is None
    assert envs.get("DLINFER_HUGE_PAGES", env) is None
    with pytest.raises(KeyError, match="DLINFER_NOPE is not a dlinfer setting"):
        envs.get("DLINFER_NOPE", env)


def test_effective_values_and_unknown_names():
    env = {"DLINFER_HUGE_PAGES": "0", "DLINFER_HUGEPAGES": "0", "PATH": "/bin"}
    values = {name: (value, is_set) for name, value, is_set in envs.effective(env)}
    assert values["DLINFER_HUGE_PAGES"] == ("0", True)
    assert values["DLINFER_LM_HEAD"] == ("auto", False)
    assert envs.unknown(env) == ["DLINFER_HUGEPAGES"]


def test_env_prints_every_setting(monkeypatch):
    import dlinfer.__main__ as cli

    monkeypatch.setenv("DLINFER_LM_HEAD", "int8")
    monkeypatch.setenv("DLINFER_LMHEAD", "int8")
    lines = cli._settings_lines()
    text = "\n".join(lines)
    for s in envs.SETTINGS:
        assert re.search(rf"^  {s.name} +\S", text, re.M), s.name
    assert re.search(r"^  DLINFER_LM_HEAD +int8$", text, re.M)
    assert re.search(r"^  DLINFER_HUGE_PAGES +\[1\]$", text, re.M)
    assert "DLINFER_LMHEAD" in text and "NOT a dlinfer setting" in text
