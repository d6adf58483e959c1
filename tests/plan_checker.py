"""An outside checker for nimble's plan document: it reads only the JSON, and uses networkx.

    python tests/plan_checker.py plan.json     # exit 0 when every guarantee holds

Checks (for every schedule): issue order is topological; every dependency is enforced by stream
order plus event waits; each wait crosses streams. For `auto` schedules also: ops with no path
between them are on different streams, and the waits number |E(reduction)| - |maximum matching|.
"""

from __future__ import annotations

import json
import sys

import networkx as nx


def check(doc: dict) -> list[str]:
    """Every broken guarantee, as a sentence; empty when the plan is sound."""
    problems = []
    ops = doc["ops"]
    deps = nx.DiGraph()
    deps.add_nodes_from(op["id"] for op in ops)
    deps.add_edges_from((d, op["id"]) for op in ops for d in op["deps"])
    order = {op["id"]: op["order"] for op in ops}
    stream = {op["id"]: op["stream"] for op in ops}
    if sorted(order.values()) != list(range(len(ops))):
        problems.append("issue positions are not a permutation")
    for u, v in deps.edges:
        if order[u] >= order[v]:
            problems.append(f"op {v} is issued before its dependency {u}")
    sync = nx.DiGraph()
    sync.add_nodes_from(deps.nodes)
    last: dict[int, int] = {}
    for op in sorted(ops, key=lambda o: o["order"]):
        s = op["stream"]
        if s in last:
            sync.add_edge(last[s], op["id"])
        last[s] = op["id"]
        for w in op["waits"]:
            if stream[w] == s:
                problems.append(f"op {op['id']} waits on op {w} of its own stream")
            sync.add_edge(w, op["id"])
    hb = nx.transitive_closure_dag(sync)
    for u, v in deps.edges:
        if not hb.has_edge(u, v):
            problems.append(f"dependency {u} -> {v} is not enforced by streams and waits")
    if doc["syncs"] != sum(len(op["waits"]) for op in ops):
        problems.append("syncs does not count the waits")
    if doc["streams"] != len(set(stream.values())):
        problems.append("streams does not count the streams used")
    if doc["schedule"]["requested"] == "auto":
        closure = nx.transitive_closure_dag(deps)
        last = {}
        for op in sorted(ops, key=lambda o: o["order"]):
            s = op["stream"]
            if s in last and not closure.has_edge(last[s], op["id"]):
                problems.append(f"independent ops {last[s]} and {op['id']} share stream {s}")
            last[s] = op["id"]
        red = nx.transitive_reduction(deps)
        bip = nx.Graph()
        left = [("L", u) for u in deps.nodes]
        bip.add_nodes_from(left)
        bip.add_nodes_from(("R", v) for v in deps.nodes)
        bip.add_edges_from((("L", u), ("R", v)) for u, v in red.edges)
        matching = len(nx.bipartite.hopcroft_karp_matching(bip, top_nodes=left)) // 2
        if doc["syncs"] != red.number_of_edges() - matching:
            problems.append(f"{doc['syncs']} waits, but the minimum is {red.number_of_edges() - matching}")
    return problems


if __name__ == "__main__":
    found = check(json.load(open(sys.argv[1])))
    print("\n".join(found) or "plan ok")
    sys.exit(1 if found else 0)
