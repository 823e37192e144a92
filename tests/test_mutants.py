"""scripts/mutants.py (the mutation check of the kernel tests) still applies: every
mutant's text occurs exactly once in its template, and no two mutants share a name.
Running the mutants takes over an hour on two cores: docs/VALIDATION.md holds the results."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutants", mod)  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_every_mutant_applies_to_the_current_templates():
    mod = _mutants()
    names = [m.name for m in mod.MUTANTS]
    assert len(names) == len(set(names)) and len(names) >= 20
    for m in mod.MUTANTS:
        text = (ROOT / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.name}: its text occurs {text.count(m.old)} times in {m.path}"
        assert m.old != m.new and text.replace(m.old, m.new) != text
    assert mod.main(["--list"]) == 0
