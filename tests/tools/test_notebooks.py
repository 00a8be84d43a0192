"""Every notebook under examples/ runs top to bottom on CPU (nbclient), and is committed without outputs."""
import os
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))


def test_notebooks_are_committed_without_outputs():
    assert NOTEBOOKS, "examples/*.ipynb not found"
    for path in NOTEBOOKS:
        code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code), path.name


# running them is the slow tier (CI's time budget; the notebook API's calls are tests/model/test_api.py's)
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{path.name}: outputs not stripped"
    # the kernel imports this checkout's packages, whatever is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()   # raises on a failing cell
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors and all(c.execution_count for c in code)
