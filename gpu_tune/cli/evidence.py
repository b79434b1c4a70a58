"""``gpu-tune evidence``: the evidence bundles kept at the moment a hardware fault was first seen
(docs/health.md "Evidence"), listed, or one of them printed. Read only."""


from typing import Annotated, Optional

import typer

from gpu_tune.cli.app import Globals, command, console, open_host, print_json
from gpu_tune.errors import HostError, InputError


@command("evidence", help="The evidence bundles kept under /var/lib/gpu-tune/evidence when a hardware fault was "
                          "first seen: `gpu-tune evidence` lists them (newest first), `gpu-tune evidence show NAME` "
                          "prints one. Read only. Exit 0; 1 the folder or the bundle cannot be read; 2 a name that "
                          "is not there.")
def evidence_cmd(
    g: Globals,
    action: Annotated[Optional[str], typer.Argument(metavar="[list|show]", help="list (the default) or show")] = None,
    name: Annotated[Optional[str], typer.Argument(metavar="[NAME]", help="With show: the bundle's name")] = None,
) -> int:
    from gpu_tune.judge.evidence import settings_from_env

    act = action or "list"
    if act not in ("list", "show"):
        raise InputError(f"gpu-tune evidence {ascii(act[:40])}: expected list or show NAME")
    if act == "list" and name is not None:
        raise InputError("gpu-tune evidence list takes no name (gpu-tune evidence show NAME prints one)")
    if act == "show" and not name:
        raise InputError("gpu-tune evidence show: give the bundle's NAME (gpu-tune evidence lists them)")
    settings = settings_from_env()
    fs = open_host(g)
    if act == "show":
        return _show(g, fs, name or "")
    from gpu_tune.judge.evidence.listing import list_bundles

    doc, ok = list_bundles(fs, settings)
    if g.output == "json":
        print_json(doc)
        return 0 if ok else 1
    from rich.table import Table
    from rich.text import Text

    from gpu_tune.judge.evidence.bundle import size_words
    from gpu_tune.views.text import printable

    out = console()
    t = Table(header_style="bold")
    for col in ("bundle", "created", "findings", "size", "nvidia-bug-report.sh"):
        t.add_column(col, overflow="fold")
    for r in doc["bundles"]:
        finds = ", ".join(str(k) for k in r["findings"][:4]) + (f" and {len(r['findings']) - 4} more"
                                                                if len(r["findings"]) > 4 else "")
        t.add_row(Text(r["name"]), Text(str(r["created"] or "?")), Text(printable(finds, one_line=True)),
                  Text(size_words(r["bytes"]) + (" (cut)" if r["cut"] else "")),
                  Text(printable(r["bug_report"], one_line=True)))
    if doc["bundles"]:
        out.print(t)
    b = doc["bounds"]
    out.print(Text(f"{len(doc['bundles'])} bundle(s), {size_words(doc['bytes'])} in {doc['folder']} (kept: the newest "
                   f"{b['keep']}, at most {size_words(b['max_bytes'])} in all, {size_words(b['bundle_bytes'])} each)"))
    for note in doc["notes"]:
        out.print(Text(printable(note, one_line=True)), soft_wrap=True)
    return 0 if ok else 1


def _show(g: Globals, fs, name: str) -> int:
    from gpu_tune.judge.evidence.listing import show_bundle

    try:
        doc = show_bundle(fs, name)
    except HostError as exc:
        if g.output == "json":
            print_json({"name": name, "notes": [str(exc)]})
        else:
            console().print(str(exc), markup=False, highlight=False)
        return 1
    if g.output == "json":
        print_json(doc)
        return 0 if doc["manifest"] is not None else 1
    from rich.text import Text

    from gpu_tune.judge.evidence.bundle import size_words
    from gpu_tune.views.text import printable

    out = console()
    man = doc["manifest"] if isinstance(doc["manifest"], dict) else {}
    verdict = doc["verdict"] if isinstance(doc["verdict"], dict) else {}
    lines = [f"bundle {doc['path']} ({size_words(doc['bytes'])}{', cut: see the files' if man.get('cut') else ''})",
             f"created {man.get('created', '?')} on node {man.get('node', '?')}, boot {man.get('boot_id', '?')}",
             f"verdict: {'ready' if verdict.get('ready') else 'not ready'}: {verdict.get('reason', '?')}: "
             f"{verdict.get('message', '')}"]
    finds = man.get("findings") if isinstance(man.get("findings"), list) else []
    lines += [f"finding {f.get('key')}: {f.get('detail', '')}" for f in finds if isinstance(f, dict)]
    metas = man.get("files") if isinstance(man.get("files"), dict) else {}
    lines += [f"file {f['file']}: {size_words(f['bytes'])}" + _cut(metas.get(f["file"])) for f in doc["files"]]
    lines.append(f"nvidia-bug-report.sh: {doc['bug_report_words']}")
    lines += [f"note: {n}" for n in doc["notes"]]
    for line in lines:
        out.print(Text(printable(line, one_line=True)), soft_wrap=True)
    if doc["kernel_log"]:
        out.print(Text("kernel log (kernel-log.txt):", style="bold"))
        out.print(Text(printable(doc["kernel_log"].rstrip("\n"))), soft_wrap=True)
    return 0 if doc["manifest"] is not None else 1


def _cut(meta) -> str:
    if isinstance(meta, dict) and meta.get("cut"):
        return f" (cut: {meta.get('of', '?'):,} bytes before)" if isinstance(meta.get("of"), int) else " (cut)"
    return ""
