"""The cluster commands: ``label`` (publish once) and ``fleet`` (every GPU node, read-only)."""


import logging
import sys
from typing import Annotated, Optional

import typer

from gpu_tune.cli.app import Globals, Mode, ProfileOpt, TaintOpt, command, print_json

log = logging.getLogger("gpu_tune")


@command("label", help="Publish labels, taint and condition for this node once.")
def label_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    node: Annotated[Optional[str], typer.Option("--node", envvar="NODE_NAME", help="Node name [default: env NODE_NAME]")] = None,
    kubeconfig: Annotated[Optional[str], typer.Option("--kubeconfig", envvar="KUBECONFIG", metavar="FILE")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be published; write nothing")] = False,
    mode: Annotated[Mode, typer.Option("--mode", case_sensitive=False, help="Publish as the agent in this mode would "
                                       "(audit and revert never taint; a Node label gpu-tune.io/mode=audit|revert "
                                       "lowers it, as for the agent); the host is never written")] = Mode.audit,
    taint: TaintOpt = None,
) -> int:
    from gpu_tune.cluster.oneshot import label_once

    return label_once(g, profile=profile, node=node, kubeconfig=kubeconfig, dry_run=dry_run, mode=mode.value,
                      taint=taint)


@command("fleet", help="Every GPU node's readiness as the agents published it, from the API server (read-only). "
                        "Exit 0 all ready, 1 some not ready or not reporting, or --selector matches no GPU node.")
def fleet_cmd(
    g: Globals,
    selector: Annotated[Optional[str], typer.Option("--selector", "-l", metavar="S",
                                                    help="Only nodes matching this label selector, as kubectl -l")] = None,
    kubeconfig: Annotated[Optional[str], typer.Option("--kubeconfig", metavar="FILE",
                                                      help="[default: KUBECONFIG, else ~/.kube/config, else in-cluster]")] = None,
    context: Annotated[Optional[str], typer.Option("--context", metavar="NAME", help="kubeconfig context")] = None,
    stale_after: Annotated[float, typer.Option("--stale-after", min=1.0, metavar="MINUTES",
                                               help="A GPUHostReady condition not re-written for this long means "
                                                    "the agent is not running (it re-writes it every 10 minutes)")] = 30.0,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=1, metavar="N",
                                            help="Nodes per page of the list call, as kubectl --chunk-size")] = 500,
) -> int:
    import time

    from gpu_tune.cluster.fleet import judge_node, render_table, report_of
    from gpu_tune.cluster.api import list_nodes, reader_configuration

    cfg, source = reader_configuration(kubeconfig, context)
    now, stale = time.time(), stale_after * 60.0
    # each Node judged as its page arrives: what is kept is one row per GPU node, not the fleet's JSON
    listing = list_nodes(cfg, selector=selector, page_size=chunk_size, source=source,
                         keep=lambda node: judge_node(node, now=now, stale_after_s=stale))
    log.info("listed %d nodes from %s in %d page(s) (%s)", len(listing.items), listing.server, listing.pages, source)
    report = report_of(listing.items, now=now, stale_after_s=stale)
    if g.output == "json":
        print_json(report.as_dict())
    else:
        from gpu_tune.views.text import printable

        sys.stdout.write(printable(render_table(report)))  # node names, reasons: the API server's text
    if selector is not None and not report.nodes:
        # a typo in a selector must not read as "every node ready" to a script
        matched = (f"{len(listing.items)} node(s) match it, none a GPU node or running the agent"
                   if listing.items else "no node matches it")
        from gpu_tune.views.text import printable

        print(f"gpu-tune: error: --selector {printable(repr(selector), one_line=True)}: {matched}", file=sys.stderr)
        return 1
    return report.exit_code
