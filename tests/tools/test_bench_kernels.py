"""benchmarks/bench_kernels.py's command line over its section modules (kernels_kda, kernels_mla, ...) at toy
sizes on CPU (kernels interpreted): the default KDA and MLA decode rows, each with its bytes and roof; the
`checks` section's rows from both kernels' modules, each within its reference (slow); an unknown section is a
usage error."""
import pytest

from benchmarks import bench_kernels, kernels_kda

pytestmark = pytest.mark.interpret


@pytest.mark.slow     # CI's time budget; the GPU queue runs the benchmark itself
def test_decode_sections_make_their_default_rows():
    rows = bench_kernels.main(["--tiny", "--only", "kda_decode,mla_decode", "--no-fla", "--budget", "1e9"])
    assert [(r["kernel"], r["case"], r["call"]) for r in rows] == [
        ("KDA decode", "N=4 H=2", "isolated"), ("MLA decode", "N=2 ctx=64 H=4 page 64", "isolated")]
    assert rows[0]["variant"].endswith("(default)") and rows[1]["variant"] == "default"
    assert all(r["us"] > 0 and r["tb_s"] > 0 and r["roof"] > 0 for r in rows)
    assert rows[1]["tflop_s"] > 0 and rows[0]["target"].startswith(("met", "missed"))


@pytest.mark.slow
def test_checks_section_rows_come_from_both_kernels_and_match_their_references():
    rows = bench_kernels.main(["--tiny", "--only", "checks", "--no-fla", "--budget", "1e9"])
    assert {r["call"] for r in rows} == {"check"}
    mla = [r for r in rows if r["kernel"] == "MLA decode"]
    kda = [r for r in rows if r["kernel"] == "KDA decode"]
    assert len(mla) == 4 and len(kda) == len(kernels_kda.KDA_DECODE_VARIANTS) and len(rows) == len(mla) + len(kda)
    for r in rows:
        err = float(r["target"].removeprefix("rel err "))
        assert err < (2e-3 if "bfloat16" in r["variant"] else 1e-5), r


def test_an_unknown_section_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_kernels.main(["--tiny", "--only", "kda_decode,nope"])
    assert e.value.code == 2 and "unknown section(s) ['nope']" in capsys.readouterr().err


def test_mla_spec_names_an_explicit_split_count():
    """'s33' fixes the key splits (all live); 'st' and 'sl' keep their meanings beside it."""
    from benchmarks.kernel_inputs import parse_mla_spec, resolve_mla_config
    knobs, _ = parse_mla_spec("T-w4-st3-sl64-s33")
    assert knobs == {"transposed": True, "num_warps": 4, "num_stages": 3, "slots": 64, "splits": 33}
    assert dict(resolve_mla_config(parse_mla_spec("T-w4-s33")[0], 32, 16, 8192, 4))["splits"] == 33
