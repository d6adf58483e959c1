"""Dinic's maximum flow on a directed graph with integer capacities; iterative, with an optional
budget of edge visits after which it gives up (returns None)."""

from __future__ import annotations


class FlowNetwork:
    def __init__(self, n: int):
        self.n = n
        self.head: list[list[int]] = [[] for _ in range(n)]  # edge ids leaving each node
        self.to: list[int] = []
        self.cap: list[int] = []

    def add_edge(self, u: int, v: int, cap: int) -> None:
        """Edge u -> v of capacity `cap` (its residual twin is the next edge id)."""
        self.head[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(cap)
        self.head[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0)

    def max_flow(self, s: int, t: int, budget: int | None = None) -> int | None:
        """The maximum flow from s to t; None if it would take more than `budget` edge visits."""
        total = 0
        self.visits = 0
        while True:
            level = self._levels(s, t)
            if level is None:
                return total
            cursor = [0] * self.n
            while True:
                pushed = self._push(s, t, level, cursor)
                if not pushed:
                    break
                total += pushed
            if budget is not None and self.visits > budget:
                return None

    def _levels(self, s: int, t: int) -> list[int] | None:
        level = [-1] * self.n
        level[s] = 0
        queue, i = [s], 0
        self.visits += len(self.to)  # a phase walks each edge about once in the search, once in the pushes
        while i < len(queue):
            u = queue[i]
            i += 1
            for e in self.head[u]:
                if self.cap[e] > 0 and level[self.to[e]] < 0:
                    level[self.to[e]] = level[u] + 1
                    queue.append(self.to[e])
        return level if level[t] >= 0 else None

    def _push(self, s: int, t: int, level: list[int], cursor: list[int]) -> int:
        """One augmenting path along the level graph (depth-first, iterative); its flow."""
        path: list[int] = []  # edge ids from s
        u = s
        while True:
            if u == t:
                flow = min(self.cap[e] for e in path)
                for e in path:
                    self.cap[e] -= flow
                    self.cap[e ^ 1] += flow
                return flow
            edges = self.head[u]
            while cursor[u] < len(edges):
                e = edges[cursor[u]]
                v = self.to[e]
                if self.cap[e] > 0 and level[v] == level[u] + 1:
                    break
                cursor[u] += 1
            else:
                if u == s:
                    return 0
                level[u] = -1  # dead end this phase
                e = path.pop()
                u = self.to[e ^ 1]
                cursor[u] += 1
                continue
            path.append(e)
            u = self.to[e]
