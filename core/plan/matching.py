"""Hopcroft-Karp maximum bipartite matching, iterative (no recursion limit), deterministic."""

from __future__ import annotations


def hopcroft_karp(adj: list[list[int]], n_right: int) -> list[int]:
    """Maximum matching of the bipartite graph with left vertex u adjacent to right vertices
    adj[u]. Returns match[u] = the right vertex matched to u, or -1. O(E sqrt(V))."""
    n_left = len(adj)
    match_l, match_r = [-1] * n_left, [-1] * n_right
    for u in range(n_left):  # greedy start: most of a DAG's matching is found here
        for v in adj[u]:
            if match_r[v] == -1:
                match_l[u], match_r[v] = v, u
                break
    while True:
        dist = _layers(adj, match_l, match_r)
        if dist is None:
            return match_l
        cursor = [0] * n_left
        for root in range(n_left):
            if match_l[root] == -1:
                _augment_from(root, adj, match_l, match_r, dist, cursor)


def _layers(adj, match_l, match_r) -> list[int] | None:
    """BFS layers from the free left vertices; None when no augmenting path exists."""
    dist = [-1] * len(adj)
    queue = [u for u in range(len(adj)) if match_l[u] == -1]
    for u in queue:
        dist[u] = 0
    found = False
    head = 0
    while head < len(queue):
        u = queue[head]
        head += 1
        for v in adj[u]:
            w = match_r[v]
            if w == -1:
                found = True
            elif dist[w] == -1:
                dist[w] = dist[u] + 1
                queue.append(w)
    return dist if found else None


def _augment_from(root, adj, match_l, match_r, dist, cursor) -> bool:
    """Depth-first search along the layers for one augmenting path from `root`; flips it."""
    stack, via = [root], []  # stack[i] is matched to via[i] once the path is flipped
    while stack:
        u = stack[-1]
        if cursor[u] < len(adj[u]):
            v = adj[u][cursor[u]]
            cursor[u] += 1
            w = match_r[v]
            if w == -1:
                via.append(v)
                for a, b in zip(stack, via):
                    match_l[a], match_r[b] = b, a
                return True
            if dist[w] == dist[u] + 1:
                via.append(v)
                stack.append(w)
        else:
            dist[u] = -1  # dead end for the rest of this phase
            stack.pop()
            if via:
                via.pop()
    return False
