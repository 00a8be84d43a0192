"""docs/configuration.md is what tools/gen_config_doc.py makes from the code today: every flag of the
entry points and every EngineArgs field, with defaults (regenerate with `python -m tools.gen_config_doc`)."""
import argparse

from tools import gen_config_doc


def test_configuration_doc_is_current():
    assert (gen_config_doc.ROOT / "docs" / "configuration.md").read_text() == gen_config_doc.render(), \
        "docs/configuration.md is stale: run python -m tools.gen_config_doc"


def test_every_flag_and_field_is_listed():
    text = gen_config_doc.render()
    for command in gen_config_doc.COMMANDS:
        parser = gen_config_doc.parser_of(command)
        flags = [s for a in parser._actions if not isinstance(a, argparse._HelpAction)
                 and a.help is not argparse.SUPPRESS for s in a.option_strings]
        assert flags, command
        section = text.split(f"## `python -m k3jax.{command}`")[1].split("\n## ")[0]
        assert all(f"`{f}`" in section for f in flags), command
    import dataclasses
    from serving.engine_args import EngineArgs
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    assert [n for n, _, _ in gen_config_doc.engine_fields()] == names
    engine = text.split("## `EngineArgs` and `LLM`")[1]
    assert all(f"| `{n}` |" in engine for n in names)
    assert "| `page_size` | `16` |" in engine
