"""Ingest files into a retrieval source from the command line, with a progress bar.

    python -m cairn_retrieval.ingest_cli --token-file TOKEN --source handbook \\
        --group staff docs/ notes.md

Files are .md, .markdown, .txt, .html and .htm (HTML becomes its readable text);
folders are walked for those. A document's id is its path relative to the folder
given (or its file name), so ingesting the same folder again replaces changed
files and leaves unchanged ones alone. The token must carry the `ingester` or
`admin` role; the ACL options say who may read what is ingested. Progress comes
from the service's IngestDocuments stream, one step per document written.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata, sync_channel
from cairn_retrieval.domain import MAX_DOCUMENTS_PER_REQUEST, is_document_id
from cairn_retrieval.html_text import html_to_page

SUFFIXES = frozenset({".md", ".markdown", ".txt", ".html", ".htm"})
DEFAULT_ADDRESS = "127.0.0.1:50052"
# gRPC's default limit on a request is 4 MiB; stay under it with room to spare.
REQUEST_BYTES = 3 * 1024 * 1024
REQUEST_DOCUMENTS = min(50, MAX_DOCUMENTS_PER_REQUEST)

_OUTCOME_NAMES = {
    retrieval_pb2.DOCUMENT_OUTCOME_INGESTED: "ingested",
    retrieval_pb2.DOCUMENT_OUTCOME_UNCHANGED: "unchanged",
    retrieval_pb2.DOCUMENT_OUTCOME_REPLACED: "replaced",
    retrieval_pb2.DOCUMENT_OUTCOME_FAILED: "failed",
}


class UsageError(Exception):
    """Something the person running the command can fix; printed without a traceback."""


@dataclass(frozen=True)
class LocalFile:
    path: Path
    document_id: str


def document_id_for(relative: str, *, prefix: str = "") -> str:
    """A document id from a relative path: anything but letters, digits and
    . _ : / @ + = - becomes '-' (the ids this tool has always made, so files
    ingested before keep theirs)."""
    cleaned = re.sub(r"[^A-Za-z0-9._:/@+=-]", "-", prefix + relative).lstrip("._:/@+=-")
    cleaned = cleaned[:200]
    if not cleaned or not is_document_id(cleaned):
        raise UsageError(f"cannot make a document id from {relative!r}; rename the file")
    return cleaned


def find_files(paths: Sequence[str], *, prefix: str = "") -> list[LocalFile]:
    found: list[LocalFile] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                if file.suffix.lower() in SUFFIXES:
                    relative = file.relative_to(path).as_posix()
                    found.append(LocalFile(file, document_id_for(relative, prefix=prefix)))
        elif path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise UsageError(
                    f"{given!r} is not a text file this command reads; "
                    f"give files ending in {', '.join(sorted(SUFFIXES))} or a folder"
                )
            found.append(LocalFile(path, document_id_for(path.name, prefix=prefix)))
        else:
            raise UsageError(f"{given!r} does not exist")
    ids = Counter(f.document_id for f in found)
    clashes = sorted(i for i, n in ids.items() if n > 1)
    if clashes:
        raise UsageError(
            f"two files would get the same document id {clashes[0]!r}; "
            "ingest those folders separately with different --id-prefix values"
        )
    return found


def read_document(
    file: LocalFile, *, source: str, acl: retrieval_pb2.Acl
) -> retrieval_pb2.Document:
    try:
        raw = file.path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raw = file.path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read {str(file.path)!r}: {exc.strerror}") from exc
    title = file.path.stem
    text = raw
    if file.path.suffix.lower() in (".html", ".htm"):
        page = html_to_page(raw)
        title, text = page.title or title, page.text
    elif file.path.suffix.lower() in (".md", ".markdown"):
        heading = next((line for line in raw.splitlines() if line.startswith("# ")), "")
        title = heading[2:].strip() or title
    return retrieval_pb2.Document(
        document_id=file.document_id, source=source, title=title, text=text, acl=acl
    )


def batches(
    files: Sequence[LocalFile], *, source: str, acl: retrieval_pb2.Acl
) -> Iterator[list[retrieval_pb2.Document]]:
    batch: list[retrieval_pb2.Document] = []
    size = 0
    for file in files:
        document = read_document(file, source=source, acl=acl)
        document_size = document.ByteSize()
        if batch and (len(batch) >= REQUEST_DOCUMENTS or size + document_size > REQUEST_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(document)
        size += document_size
    if batch:
        yield batch


def _explain(exc: grpc.RpcError, address: str) -> str:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code is grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach the retrieval service at {address} ({details}); is it running?"
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return f"the token was refused: {details}"
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return "the token may not ingest: it needs the 'ingester' or 'admin' role"
    name = code.name if code is not None else "error"
    return f"the retrieval service answered {name}: {details}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cairn_retrieval.ingest_cli", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to ingest")
    parser.add_argument("--token-file", required=True, help="file holding the caller's JWT")
    parser.add_argument("--source", required=True, help="the source (corpus) to ingest into")
    parser.add_argument("--user", action="append", default=[], help="a user who may read")
    parser.add_argument("--role", action="append", default=[], help="a role that may read")
    parser.add_argument("--group", action="append", default=[], help="a group that may read")
    parser.add_argument("--id-prefix", default="", help="prepended to every document id")
    parser.add_argument(
        "--address",
        default=os.environ.get("CAIRN_RETRIEVAL_ADDR", DEFAULT_ADDRESS),
        help=f"retrieval host:port (default $CAIRN_RETRIEVAL_ADDR or {DEFAULT_ADDRESS})",
    )
    args = parser.parse_args(argv)
    console = Console(stderr=True, soft_wrap=True)
    try:
        return _run(args, console)
    except UsageError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    try:
        token = Path(args.token_file).read_text().strip()
    except OSError as exc:
        raise UsageError(f"cannot read the token file {args.token_file!r}: {exc.strerror}") from exc
    if not token:
        raise UsageError(f"the token file {args.token_file!r} is empty")
    if not (args.user or args.role or args.group):
        raise UsageError(
            "say who may read these documents with --user, --role or --group; "
            "a document with an empty ACL is readable by nobody"
        )
    acl = retrieval_pb2.Acl(users=args.user, roles=args.role, groups=args.group)
    files = find_files(args.paths, prefix=args.id_prefix)
    if not files:
        raise UsageError("no .md, .txt or .html files were found in the paths given")

    outcomes: Counter[str] = Counter()
    chunks = 0
    failures: list[tuple[str, str]] = []
    with sync_channel(args.address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[chunks]} chunks"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(f"ingesting into {args.source}", total=len(files), chunks=0)
            try:
                for batch in batches(files, source=args.source, acl=acl):
                    stream = stub.IngestDocuments(
                        retrieval_pb2.IngestDocumentsRequest(documents=batch),
                        metadata=call_metadata(token),
                        timeout=600,
                    )
                    for update in stream:
                        result = update.result
                        outcomes[_OUTCOME_NAMES.get(result.outcome, "unknown")] += 1
                        if result.outcome == retrieval_pb2.DOCUMENT_OUTCOME_FAILED:
                            failures.append((result.document_id, result.error))
                            progress.console.print(
                                f"[red]failed[/] {result.document_id}: {result.error}"
                            )
                        else:
                            chunks += result.chunks
                        progress.update(task, advance=1, chunks=chunks)
            except grpc.RpcError as exc:
                progress.stop()
                console.print(f"[red]error:[/] {_explain(exc, args.address)}")
                console.print(
                    f"{sum(outcomes.values())} of {len(files)} documents were handled before it"
                )
                return 1
    summary = ", ".join(f"{n} {name}" for name, n in sorted(outcomes.items()))
    console.print(f"{len(files)} documents: {summary}; {chunks} chunks in {args.source!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
