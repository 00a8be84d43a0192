"""Import a file of scripts/ (not a package) as a module, for the tests of its functions."""
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script(name: str):
    if str(ROOT / "scripts") not in sys.path:      # scripts import their siblings (tables, bench_e2e) by name
        sys.path.append(str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
