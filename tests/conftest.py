"""Shared test helpers. ``record`` appends measured error figures to the file named by
KDAGEN_RECORD (the GPU check script collects them for docs/VALIDATION.md)."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture
def record(request):
    def _record(**values):
        path = os.environ.get("KDAGEN_RECORD")
        if not path:
            return
        row = {"test": request.node.nodeid.split("::", 1)[-1], **values}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    return _record
