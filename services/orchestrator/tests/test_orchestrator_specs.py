"""Agent specs: the shipped handbook spec loads, and every malformed spec is
refused with an error naming its file and field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cairn_libs.stack import REPO_ROOT
from cairn_orchestrator.errors import AgentSpecInvalid, UnknownAgent
from cairn_orchestrator.memory_tools import MEMORY_TOOL_NAMES
from cairn_orchestrator.specs import load_agent_specs

KNOWN_TOOLS = ["search_knowledge", *MEMORY_TOOL_NAMES]

VALID = {
    "name": "helper",
    "description": "Helps.",
    "tier": "fast",
    "system_prompt": "You help.",
    "tools": ["search_knowledge"],
    "sources": ["handbook"],
    "reads_memory": False,
    "budgets": {"tokens": 1000, "model_calls": 2, "wall_seconds": 10},
}


def write_spec(folder: Path, document: object, *, file: str = "helper.yaml") -> Path:
    path = folder / file
    path.write_text(yaml.safe_dump(document))
    return path


def test_the_shipped_handbook_agent_loads_with_its_tool_sources_and_budgets() -> None:
    catalog = load_agent_specs(REPO_ROOT / "agents", known_tools=KNOWN_TOOLS)
    spec = catalog.get("handbook")
    assert spec.tier == "balanced"
    assert spec.tools == ("search_knowledge",)
    assert spec.sources == ("handbook",)
    assert spec.reads_memory is True
    assert (spec.budgets.tokens, spec.budgets.model_calls, spec.budgets.wall_seconds) == (
        20000,
        6,
        60,
    )


def test_the_shipped_assistant_agent_offers_the_memory_tools() -> None:
    catalog = load_agent_specs(REPO_ROOT / "agents", known_tools=KNOWN_TOOLS)
    spec = catalog.get("assistant")
    assert set(MEMORY_TOOL_NAMES) <= set(spec.tools)
    assert spec.sources == ("handbook",) and spec.reads_memory is True


def test_a_valid_spec_loads_and_an_unknown_agent_names_the_known_ones(tmp_path: Path) -> None:
    write_spec(tmp_path, VALID)
    catalog = load_agent_specs(tmp_path, known_tools=KNOWN_TOOLS)
    assert catalog.names() == ["helper"]
    with pytest.raises(UnknownAgent) as refused:
        catalog.get("helpr")
    assert "'helpr'" in refused.value.message and "'helper'" in refused.value.message


def test_an_empty_source_list_is_a_valid_spec_that_reads_no_knowledge(tmp_path: Path) -> None:
    write_spec(tmp_path, {**VALID, "sources": []})
    assert load_agent_specs(tmp_path, known_tools=KNOWN_TOOLS).get("helper").sources == ()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": None}, "name"),
        ({"name": "Has Spaces"}, "name"),
        ({"tier": "huge"}, "tier"),
        ({"system_prompt": ""}, "system_prompt"),
        ({"tools": ["search_knowledge", "delete_everything"]}, "tools[1]"),
        ({"tools": "search_knowledge"}, "tools"),
        ({"sources": ["handbook", "handbook"]}, "sources[1]"),
        ({"sources": ["hand book"]}, "sources[0]"),
        ({"reads_memory": "yes please"}, "reads_memory"),
        (
            {"budgets": {"tokens": 1000, "model_calls": 0, "wall_seconds": 10}},
            "budgets.model_calls",
        ),
        ({"budgets": {"tokens": True, "model_calls": 2, "wall_seconds": 10}}, "budgets.tokens"),
        ({"budgets": {"tokens": 1000, "model_calls": 2}}, "budgets.wall_seconds"),
        (
            {"budgets": {"tokens": 1000, "model_calls": 2, "wall_seconds": 10, "dollars": 5}},
            "budgets.dollars",
        ),
        ({"budgets": 5}, "budgets"),
        ({"reads_memroy": True}, "reads_memroy"),
    ],
)
def test_a_malformed_spec_is_refused_naming_its_file_and_field(
    tmp_path: Path, change: dict[str, object], field: str
) -> None:
    document = {**VALID, **change}
    if change.get("name", "") is None:
        del document["name"]
    path = write_spec(tmp_path, document)
    with pytest.raises(AgentSpecInvalid) as refused:
        load_agent_specs(tmp_path, known_tools=KNOWN_TOOLS)
    assert refused.value.file == str(path)
    assert refused.value.field == field
    assert str(path) in refused.value.message and repr(field) in refused.value.message


def test_two_specs_with_one_name_are_refused_naming_both_files(tmp_path: Path) -> None:
    first = write_spec(tmp_path, VALID, file="a.yaml")
    second = write_spec(tmp_path, VALID, file="b.yml")
    with pytest.raises(AgentSpecInvalid) as refused:
        load_agent_specs(tmp_path, known_tools=KNOWN_TOOLS)
    assert refused.value.file == str(second)
    assert str(first) in refused.value.message


def test_a_file_that_is_not_yaml_or_not_a_mapping_is_refused(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(AgentSpecInvalid) as refused:
        load_agent_specs(tmp_path, known_tools=KNOWN_TOOLS)
    assert "broken.yaml" in refused.value.message and "YAML" in refused.value.message
    (tmp_path / "broken.yaml").write_text("- just\n- a list\n")
    with pytest.raises(AgentSpecInvalid) as refused:
        load_agent_specs(tmp_path, known_tools=KNOWN_TOOLS)
    assert refused.value.field == "<document>"


def test_a_missing_agents_folder_is_refused_with_the_setting_to_change(tmp_path: Path) -> None:
    with pytest.raises(AgentSpecInvalid) as refused:
        load_agent_specs(tmp_path / "nowhere", known_tools=KNOWN_TOOLS)
    assert "CAIRN_AGENTS_DIR" in refused.value.message


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"budgets": {"tokens": 1000, "model_calls": 2, "wall_seconds": 10, "dollars": 5}},
            "field 'budgets.dollars': is not a budget; known budgets: "
            "tokens, model_calls, wall_seconds",
        ),
        (
            {"tools": ["search_knowledge", "delete_everything"]},
            "field 'tools[1]': 'delete_everything' is not a registered tool; known tools: "
            + ", ".join(sorted(KNOWN_TOOLS)),
        ),
        ({"tier": "huge"}, "field 'tier': 'huge' is not one of fast, balanced, deep"),
        (
            {"budgets": {"tokens": True, "model_calls": 2, "wall_seconds": 10}},
            "field 'budgets.tokens': True must be a positive whole number",
        ),
    ],
)
def test_the_declared_spec_model_keeps_the_sentence_a_person_fixing_the_file_needs(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    path = write_spec(tmp_path, {**VALID, **change})
    with pytest.raises(AgentSpecInvalid) as refused:
        load_agent_specs(tmp_path, known_tools=KNOWN_TOOLS)
    assert refused.value.message == f"{path}: {message}"
