"""scripts/ab_variants.sh prepares its variants as asked (checked with KDAGEN_AB_DRY, which
stops before the builds): constants set, trees taken, patches applied in turn, a bad
argument refused before any device time is spent."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROLOGUE = "templates/include/kdagen/prologue.h"


def _ab(tmp_path: Path, *variants: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KDAGEN_AB_DRY="1", KDAGEN_AB_ROOT=str(tmp_path / "ab"))
    return subprocess.run(["bash", "scripts/ab_variants.sh", "8x4096:32 lower_bound 16 128", *variants],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _patch_of_prologue(tmp_path: Path) -> Path:
    """A `git diff`-style patch of the prologue template: a marker comment before its first line."""
    lines = (ROOT / PROLOGUE).read_text().splitlines(keepends=True)
    patch = tmp_path / "marker.patch"
    patch.write_text(f"--- a/{PROLOGUE}\n+++ b/{PROLOGUE}\n@@ -1,1 +1,2 @@\n"
                     f"+// ab-variants-test-marker\n {lines[0]}")
    return patch


def test_variants_take_constants_trees_and_patches(tmp_path):
    patch = _patch_of_prologue(tmp_path)
    tree = tmp_path / "tree"  # another tree: this checkout's folders, its prologue marked
    for folder in ("kdagen", "templates", "scripts"):
        shutil.copytree(ROOT / folder, tree / folder)
    (tree / PROLOGUE).write_text("// ab-variants-test-marker\n" + (ROOT / PROLOGUE).read_text())
    r = _ab(tmp_path, "base:", "st3:CHUNK_STAGES=3", f"p+{patch}:CHUNK_STAGES=3", f"t@{tree}:")
    assert r.returncode == 0, r.stdout + r.stderr
    ab = tmp_path / "ab"
    assert sorted(p.name for p in ab.iterdir()) == ["base", "p", "st3", "t"]
    resources = (ROOT / "kdagen/resources.py").read_text()
    for name, stages in (("base", None), ("st3", "3"), ("p", "3"), ("t", None)):
        res = (ab / name / "kdagen/resources.py").read_text()
        if stages:
            assert f"\nCHUNK_STAGES = {stages}\n" in res
        else:
            assert res == resources, name
        marked = "ab-variants-test-marker" in (ab / name / PROLOGUE).read_text()
        assert marked == (name in ("p", "t")), name
    assert (ab / "base" / PROLOGUE).read_text() == (ROOT / PROLOGUE).read_text()


def test_patches_stack_in_the_order_given(tmp_path):
    first = _patch_of_prologue(tmp_path)
    second = tmp_path / "second.patch"  # its context is the first patch's marker
    first_line = (ROOT / PROLOGUE).read_text().splitlines(keepends=True)[0]
    second.write_text(f"--- a/{PROLOGUE}\n+++ b/{PROLOGUE}\n@@ -1,2 +1,3 @@\n"
                      f" // ab-variants-test-marker\n+// second-marker\n {first_line}")
    r = _ab(tmp_path, f"pq+{first}+{second}:")
    assert r.returncode == 0, r.stdout + r.stderr
    head = (tmp_path / "ab/pq" / PROLOGUE).read_text().splitlines()[:2]
    assert head == ["// ab-variants-test-marker", "// second-marker"]
    r = _ab(tmp_path, f"qp+{second}+{first}:")  # the second alone does not apply
    assert r.returncode == 2 and "does not apply to qp" in r.stdout, r.stdout + r.stderr


def test_a_patch_that_does_not_apply_is_refused(tmp_path):
    bad = tmp_path / "bad.patch"
    bad.write_text(f"--- a/{PROLOGUE}\n+++ b/{PROLOGUE}\n@@ -1,1 +1,1 @@\n-no such line\n+other\n")
    r = _ab(tmp_path, f"p+{bad}:")
    assert r.returncode == 2 and "does not apply" in r.stdout, r.stdout + r.stderr


def test_an_unknown_constant_is_refused(tmp_path):
    r = _ab(tmp_path, "x:NO_SUCH_CONSTANT=1")
    assert r.returncode == 2 and "no constant NO_SUCH_CONSTANT" in r.stdout, r.stdout + r.stderr
