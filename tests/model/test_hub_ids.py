"""Hugging Face model ids (--model ORG/NAME) resolve through huggingface_hub's cache, laid out as the hub
lays it out (models--ORG--NAME/refs/REV -> snapshots/COMMIT/...), with the hub offline."""
import os

import numpy as np
import pytest

from tools import synthetic_k3
from k3jax import info
from k3jax.api import load_model
from k3jax.checkpoint import hub

REPO = "acme/tiny-k3"
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A hub cache holding two revisions of one repository (different weights), and nothing else."""
    cache = tmp_path_factory.mktemp("hf-cache")
    repo = cache / ("models--" + REPO.replace("/", "--"))
    for seed, (ref, commit) in enumerate(COMMITS.items()):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        synthetic_k3.write_checkpoint(repo / "snapshots" / commit, seed=seed, vision=False)
    return str(cache)


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 as a user sets it (huggingface_hub reads its constants at import)."""
    from huggingface_hub import constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_repo_id_shapes(tmp_path, monkeypatch):
    assert hub.looks_like_repo_id("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    assert not hub.looks_like_repo_id("tiny") and not hub.looks_like_repo_id("/abs/path")
    assert not hub.looks_like_repo_id("a/b/c") and not hub.looks_like_repo_id("../x")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.looks_like_repo_id("org/name")          # an existing relative directory is a directory


def test_model_id_loads_from_the_cache_at_each_revision(hub_cache, offline):
    tokens = [[1, 2, 3, 4]]
    main = load_model(REPO, dtype="float32", download_dir=hub_cache)
    assert main.name == REPO
    direct = load_model(os.path.join(hub_cache, "models--acme--tiny-k3", "snapshots", COMMITS["main"]), dtype="float32")
    np.testing.assert_array_equal(main.logits(tokens), direct.logits(tokens))
    v1 = load_model(REPO, dtype="float32", download_dir=hub_cache, revision="v1")
    assert not np.allclose(v1.logits(tokens), main.logits(tokens))    # the other revision's weights


def test_missing_id_offline_is_one_error_naming_id_and_cache(hub_cache, offline, capsys):
    with pytest.raises(ValueError) as e:
        load_model("acme/absent", download_dir=hub_cache)
    msg = str(e.value)
    assert "acme/absent" in msg and hub_cache in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ValueError, match="revision nope"):
        load_model(REPO, download_dir=hub_cache, revision="nope")
    # the CLIs print it as one error line (info resolves the config only)
    assert info.main(["--model", "acme/absent", "--download-dir", hub_cache]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "acme/absent" in err[0]
    assert info.main(["--model", REPO, "--download-dir", hub_cache, "--json"]) == 0
    assert '"layers"' in capsys.readouterr().out
