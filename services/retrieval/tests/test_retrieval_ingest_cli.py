"""The command-line ingester, run as a person would: a real process against a real
retrieval service."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cairn_libs.stack import free_port
from cairn_retrieval.ingest_cli import UsageError, document_id_for

if TYPE_CHECKING:
    from conftest import Org, RunningRetrieval


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cairn_retrieval.ingest_cli", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env={"COLUMNS": "120", "PATH": "/usr/bin:/bin"},
    )


def _folder(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    (docs / "guides").mkdir(parents=True)
    (docs / "guides" / "parking.md").write_text(
        "# Parking rules\n\nVisitors park on level minus two of the garage.\n"
    )
    (docs / "canteen.html").write_text(
        "<html><head><title>Canteen</title><script>var x = 'garage';</script></head>"
        "<body><nav>Home | Menu</nav><h1>Canteen</h1><p>Soup is served at noon.</p></body></html>"
    )
    (docs / "notes.txt").write_text("The library closes at six.")
    (docs / "picture.png").write_bytes(b"\x89PNG not text")
    return docs


def test_ingesting_a_folder_reports_every_document_and_makes_it_searchable(
    keyword_retrieval: RunningRetrieval, org: Org, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(org.ingester())

    run = _cli(
        "--token-file", str(token), "--source", "handbook", "--group", "staff",
        "--address", keyword_retrieval.process.address, str(_folder(tmp_path)),
    )  # fmt: skip

    assert run.returncode == 0, run.stderr
    assert "3 documents: 3 ingested; 3 chunks in 'handbook'" in run.stderr
    reader = org.reader(groups=["staff"])
    garage = keyword_retrieval.client.search(reader, "garage visitors", ["handbook"])
    assert [(r.document_id, r.title) for r in garage.results] == [
        ("guides/parking.md", "Parking rules")
    ]
    soup = keyword_retrieval.client.search(reader, "soup", ["handbook"]).results[0]
    assert (soup.document_id, soup.title) == ("canteen.html", "Canteen")
    assert "Menu" not in soup.text and "var x" not in soup.text

    again = _cli(
        "--token-file", str(token), "--source", "handbook", "--group", "staff",
        "--address", keyword_retrieval.process.address, str(tmp_path / "docs"),
    )  # fmt: skip
    assert "3 documents: 3 unchanged" in again.stderr


def test_a_token_without_the_ingester_role_is_told_what_it_lacks(
    keyword_retrieval: RunningRetrieval, org: Org, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(org.reader())

    run = _cli(
        "--token-file", str(token), "--source", "handbook", "--group", "staff",
        "--address", keyword_retrieval.process.address, str(_folder(tmp_path)),
    )  # fmt: skip

    assert run.returncode == 1
    assert "needs the 'ingester' or 'admin' role" in run.stderr


def test_an_unreachable_service_a_missing_token_and_a_missing_acl_are_clear_errors(
    org: Org, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(org.ingester())
    docs = str(_folder(tmp_path))
    nobody = f"127.0.0.1:{free_port()}"

    unreachable = _cli(
        "--token-file", str(token), "--source", "s", "--group", "g", "--address", nobody, docs
    )
    no_token = _cli("--token-file", str(tmp_path / "nope"), "--source", "s", "--group", "g", docs)
    no_acl = _cli("--token-file", str(token), "--source", "s", docs)

    assert unreachable.returncode == 1
    assert f"cannot reach the retrieval service at {nobody}" in unreachable.stderr
    assert no_token.returncode == 2 and "cannot read the token file" in no_token.stderr
    assert no_acl.returncode == 2 and "readable by nobody" in no_acl.stderr


def test_document_ids_are_cleaned_paths_and_impossible_ones_are_refused() -> None:
    assert document_id_for("guides/a file (1).md") == "guides/a-file--1-.md"
    assert document_id_for("x.md", prefix="team/") == "team/x.md"
    with pytest.raises(UsageError):
        document_id_for("###")
