"""The generated CRD: golden files, drift check, and the parts users see."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync.api import crd
from weightsync.api.schema import SchemaError, structural_schema
from weightsync.api.v1alpha1 import TransferSpec, WeightSyncSpec

REPO_ROOT = Path(__file__).resolve().parents[3]


def _version() -> dict[str, Any]:
    version: dict[str, Any] = crd.build_crd()["spec"]["versions"][0]
    return version


def test_generated_crd_matches_the_committed_file() -> None:
    # The golden test: any change to the models must come with a regenerated crds/.
    committed = (REPO_ROOT / crd.CRD_FILE).read_text()
    assert crd.render_crd() == committed, "run `python -m weightsync.api.crd` and commit crds/"


def test_chart_carries_an_identical_copy() -> None:
    assert (REPO_ROOT / crd.CHART_CRD_FILE).read_text() == (REPO_ROOT / crd.CRD_FILE).read_text()


def test_rendered_yaml_is_one_crd_document() -> None:
    documents = list(yaml.safe_load_all(crd.render_crd()))
    assert documents == [crd.build_crd()]


def _repo_copy(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text("")
    for relative in (crd.CRD_FILE, crd.CHART_CRD_FILE):
        (tmp_path / relative).parent.mkdir(parents=True)
        shutil.copy(REPO_ROOT / relative, tmp_path / relative)
    return tmp_path


def test_check_passes_on_an_up_to_date_tree(tmp_path: Path) -> None:
    assert crd.main(["--check", "--root", str(_repo_copy(tmp_path))]) == 0


@pytest.mark.parametrize("relative", [crd.CRD_FILE, crd.CHART_CRD_FILE], ids=str)
def test_check_fails_with_a_diff_when_a_file_drifts(
    tmp_path: Path, relative: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _repo_copy(tmp_path)
    stale = (root / relative).read_text().replace("maxItems: 16", "maxItems: 15")
    (root / relative).write_text(stale)

    assert crd.main(["--check", "--root", str(root)]) == 1

    out = capsys.readouterr()
    assert f"--- {relative} (committed)" in out.out
    assert "-                maxItems: 15" in out.out
    assert "+                maxItems: 16" in out.out
    assert "out of date" in out.err


def test_check_fails_when_a_file_is_missing(tmp_path: Path) -> None:
    root = _repo_copy(tmp_path)
    (root / crd.CHART_CRD_FILE).unlink()
    assert crd.main(["--check", "--root", str(root)]) == 1


def test_generate_writes_both_files(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("")
    assert crd.main(["--root", str(tmp_path)]) == 0
    for relative in (crd.CRD_FILE, crd.CHART_CRD_FILE):
        assert (tmp_path / relative).read_text() == crd.render_crd()
    assert crd.main(["--check", "--root", str(tmp_path)]) == 0


def test_refuses_a_directory_that_is_not_the_repository(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        crd.main(["--root", str(tmp_path)])
    assert not (tmp_path / "crds").exists()


def test_names_and_scope() -> None:
    spec = crd.build_crd()["spec"]
    assert crd.build_crd()["metadata"]["name"] == "weightsyncs.weightsync.io"
    assert spec["group"] == "weightsync.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "WeightSync",
        "listKind": "WeightSyncList",
        "plural": "weightsyncs",
        "singular": "weightsync",
        "shortNames": ["wsync"],
    }
    version = _version()
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns() -> None:
    columns = {column["name"]: column for column in _version()["additionalPrinterColumns"]}
    default = [name for name, column in columns.items() if column.get("priority", 0) == 0]
    assert default == ["Ready", "Version", "Members", "Last-Sync", "Age"]
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Last-Sync"]["type"] == "date"
    assert {"Mode", "Group-Generation"} <= {
        name for name, column in columns.items() if column.get("priority") == 1
    }
    # Every column reads a field the schema declares.
    schema = _version()["schema"]["openAPIV3Schema"]
    for column in columns.values():
        path = re.sub(r"\[[^]]*\]", "", column["jsonPath"]).strip(".").split(".")
        if path[0] == "metadata":
            continue
        node = schema
        for part in path:
            node = node["properties"][part]
            if node["type"] == "array":
                node = node["items"]
        assert node["type"] in ("string", "integer", "boolean"), column["name"]


def _rules(node: dict[str, Any]) -> list[str]:
    return [rule["rule"] for rule in node.get("x-kubernetes-validations", [])]


def test_cel_rules_sit_where_they_guard() -> None:
    spec = _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]
    properties = spec["properties"]
    assert _rules(properties["mode"]) == ["self == oldSelf"]
    trainer_name = properties["trainer"]["properties"]["statefulSetRef"]["properties"]["name"]
    assert _rules(trainer_name) == ["self == oldSelf"]
    assert "exists_one" in _rules(properties["inference"])[0]
    assert "Colocated" in _rules(spec)[0]
    assert spec["x-kubernetes-validations"][0]["fieldPath"] == ".inference"
    assert "pipelineDepth" in _rules(properties["transfer"])[0]
    assert properties["trainer"]["properties"]["sourceRanks"]["x-kubernetes-list-type"] == "set"


def test_nested_objects_default_to_empty_so_their_fields_default() -> None:
    properties = structural_schema(WeightSyncSpec, "spec is")["properties"]
    for name in ("transfer", "prewarm", "recovery", "readinessGate"):
        assert properties[name]["default"] == {}, name
    assert properties["trainer"]["properties"]["sourceRanks"]["default"] == [0]


def test_integer_formats_follow_the_bounds() -> None:
    properties = structural_schema(TransferSpec, "transfer is")["properties"]
    assert properties["bucketSizeBytes"]["format"] == "int64"
    assert properties["pipelineDepth"]["format"] == "int32"
    trainer = structural_schema(WeightSyncSpec, "spec is")["properties"]["trainer"]["properties"]
    assert trainer["ranksPerPod"] == {
        "description": trainer["ranksPerPod"]["description"],
        "type": "integer",
        "format": "int32",
        "minimum": 1,
        "maximum": 64,
    }
    # An int-or-string is the one untyped node; its bounds are a CEL rule on the list.
    assert trainer["sourceRanks"]["items"] == {"x-kubernetes-int-or-string": True}
    assert "r >= 0" in _rules(trainer["sourceRanks"])[0]


def test_a_union_of_types_is_refused() -> None:
    from pydantic import BaseModel

    class Ambiguous(BaseModel):
        value: int | str

    with pytest.raises(SchemaError, match=r"Ambiguous\.value: a union of several types"):
        structural_schema(Ambiguous, "ambiguous is")


def test_an_untranslated_keyword_is_refused() -> None:
    from pydantic import BaseModel, Field

    class Odd(BaseModel):
        value: int = Field(json_schema_extra={"examples": [1]})

    with pytest.raises(SchemaError, match="keyword 'examples'"):
        structural_schema(Odd, "odd is")
