"""KeyMaze: a fixed grid maze with dead ends, a key and a locked door; reach the goal.

The task GiGPO's claim is about, sized for the CPU (docs/cpu_job.md): long episodes (the
shortest solutions take 12 to 24 moves), one sparse reward at the end, and states that
recur within a trajectory (a wrong turn into a dead end and back) and across the copies
of a group (they start in the same cell). The observation is the state: the cell and
whether the key is held. The map is the same for every episode (the seed picks the
start), so a policy learns it; `expert_action` (shortest path, by breadth-first search)
makes the noisy expert trajectories the tiny model imitates before RL
(`tiny_model.warm_start`, megatron_agent/warm_start.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from envs.base import Observation, make_info, seeded_rng
from envs.projection import parse_bare_action
from envs.registry import register_env

# '#' wall, '.' floor, 'K' the key (picked up on entering), 'D' the door (open with the
# key, a wall without), 'G' the goal. Rows are separated by '/'.
DEFAULT_LAYOUT = "/".join([
    "#########",
    "#...#..K#",
    "#.#.#.###",
    "#.#...#.#",
    "#.###.#.#",
    "#.#...D.#",
    "#.#.###.#",
    "#...#..G#",
    "#########",
])
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
MAZE_INSTRUCTIONS = ("You are in a maze. Pick up the key, go through the door it opens and reach the goal. "
                     "Answer one move: up, down, left or right.")


@dataclass
class MazeConfig:
    layout: str = DEFAULT_LAYOUT
    max_steps: int = 40
    # Starts: floor cells whose shortest solution takes at least this many moves.
    min_solution_moves: int = 12


@dataclass(frozen=True)
class Grid:
    rows: tuple[str, ...]
    key: tuple[int, int]
    door: tuple[int, int]
    goal: tuple[int, int]

    def open(self, cell: tuple[int, int], has_key: bool) -> bool:
        r, c = cell
        if not (0 <= r < len(self.rows) and 0 <= c < len(self.rows[r])):
            return False
        return self.rows[r][c] not in "#D" or (self.rows[r][c] == "D" and has_key)


@lru_cache(maxsize=8)
def parse_layout(layout: str) -> Grid:
    rows = tuple(layout.split("/"))
    found = {ch: [(r, c) for r, row in enumerate(rows) for c, x in enumerate(row) if x == ch] for ch in "KDG"}
    missing = [ch for ch, cells in found.items() if len(cells) != 1]
    if missing or set("".join(rows)) - set("#.KDG"):
        raise ValueError(f"a maze layout needs one K, one D and one G on '#'/'.' cells; got {layout!r}")
    return Grid(rows, found["K"][0], found["D"][0], found["G"][0])


@lru_cache(maxsize=8)
def moves_to_goal(layout: str) -> dict[tuple[int, int, bool], int]:
    """Shortest number of moves to the goal from every reachable (row, col, has_key)."""
    grid = parse_layout(layout)
    # Backwards from the goal: a move a -> b (b open) with key state k -> k or k | (b is key).
    states = [(r, c, k) for r, row in enumerate(grid.rows) for c, x in enumerate(row) if x != "#"
              for k in (False, True)]
    successors = {s: [_moved(grid, s, name) for name in MOVES] for s in states if grid.open(s[:2], s[2])}
    predecessors: dict = {}
    for s, nexts in successors.items():
        for n in nexts:
            predecessors.setdefault(n, set()).add(s)
    distance = {(*grid.goal, True): 0, (*grid.goal, False): 0}
    queue = deque(distance)
    while queue:
        s = queue.popleft()
        for p in predecessors.get(s, ()):
            if p not in distance and p[:2] != grid.goal:
                distance[p] = distance[s] + 1
                queue.append(p)
    return distance


def _moved(grid: Grid, state: tuple[int, int, bool], move: str) -> tuple[int, int, bool]:
    r, c, has_key = state
    dr, dc = MOVES[move]
    cell = (r + dr, c + dc)
    if not grid.open(cell, has_key):
        return state
    return (*cell, has_key or cell == grid.key)


class MazeEnv:
    """Reward 1 on reaching the goal (the episode ends, won), 0 for every other step. A move
    into a wall or the locked door, or text that names no move, leaves the state as it was
    (only the latter is an invalid action)."""

    actions = tuple(MOVES)

    @staticmethod
    def instructions_for(config: MazeConfig) -> str:
        return MAZE_INSTRUCTIONS

    def __init__(self, config: MazeConfig):
        self.config = config
        self.grid = parse_layout(config.layout)
        self.distance = moves_to_goal(config.layout)
        self.starts = sorted(s[:2] for s, d in self.distance.items()
                             if not s[2] and d >= config.min_solution_moves and s[:2] != self.grid.key)
        if not self.starts:
            raise ValueError(f"no start cell needs min_solution_moves={config.min_solution_moves} moves or more")
        self.state = (0, 0, False)
        self.steps = 0
        self.done = True

    def _observation(self) -> Observation:
        r, c, has_key = self.state
        text = f"position {r} {c} key {'yes' if has_key else 'no'}"
        return Observation(text=text, anchor=text)

    def reset(self, seed: int) -> Observation:
        r, c = self.starts[int(seeded_rng(seed).integers(len(self.starts)))]
        self.state = (r, c, False)
        self.steps = 0
        self.done = False
        return self._observation()

    def expert_action(self) -> str:
        """A move on a shortest path to the goal (the first in MOVES' order among equals)."""
        return min(MOVES, key=lambda m: self.distance.get(_moved(self.grid, self.state, m), 1 << 30))

    def step(self, text: str) -> tuple[Observation, float, bool, dict]:
        if self.done:
            return self._observation(), 0.0, True, make_info(False, self.state[:2] == self.grid.goal, action=None)
        action = parse_bare_action(text, self.actions)
        self.steps += 1
        if action is not None:
            self.state = _moved(self.grid, self.state, action)
        won = self.state[:2] == self.grid.goal
        self.done = won or self.steps >= self.config.max_steps
        info = make_info(action is not None, won, action=action, truncated=self.done and not won)
        return self._observation(), float(won), self.done, info


register_env("maze", MazeEnv, MazeConfig)
