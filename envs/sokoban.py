"""Sokoban: push every box onto a target. Rooms come from reverse play on a seed.

Generation: carve a random-walk room inside the walls, put the boxes on their targets
and the player on a free cell (a solved room), then play backwards: the player walks
at random and, when stepping away from an adjacent box, may pull it along. Every pull
is a push played in reverse, so the room reached is solvable; the generator keeps the
state whose boxes ended farthest from their targets and never returns a solved room.

Rewards (gym-sokoban's shaping): -0.1 per move, +1 when a push puts a box on a target,
-1 when a push takes one off, +10 when every box is on a target (the episode ends won).
Text that does not parse is a no-op with reward 0 (verl-agent's convention; the
trainer adds its invalid-action penalty). Every step, valid or not, counts towards
max_steps (15); reaching it ends the episode, not won.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from envs.base import Observation, make_info, seeded_rng
from envs.projection import parse_tagged_action
from envs.registry import register_env

WALL, FLOOR, TARGET = 0, 1, 2
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
ACTIONS = tuple(MOVES)

STEP_REWARD = -0.1
BOX_ON_TARGET_REWARD = 1.0
BOX_OFF_TARGET_REWARD = -1.0
SOLVED_REWARD = 10.0

# Display codes, also the anchor alphabet.
SYMBOLS = {
    "wall": "#",
    "floor": "_",
    "target": "O",
    "box": "X",
    "box_on_target": "√",
    "player": "P",
    "player_on_target": "S",
}
_CODES = ("wall", "floor", "target", "box", "box_on_target", "player", "player_on_target")
_CODE_SYMBOL = np.array([SYMBOLS[c] for c in _CODES])

INSTRUCTIONS = (
    "You are playing Sokoban. Push every box onto a target. You can push a box but not pull it, "
    "and you cannot push two boxes at once or push a box into a wall.\n"
    "Symbols: # wall, _ floor, O target, X box, √ box on target, P you, S you on a target.\n"
    "Rows are listed top to bottom; 'up' moves to the row above.\n"
    "Think inside <think> </think>, then give exactly one move inside <action> </action>: "
    "up, down, left or right."
)


@dataclass
class SokobanConfig:
    dim_room: tuple[int, int] = (6, 6)
    num_boxes: int = 1
    max_steps: int = 15
    # Reverse-play moves tried per room; more moves give rooms that need more pushes.
    reverse_steps: int = 100
    render_image: bool = False
    # Pixels per cell: 16 gives 96x96 for the 6x6 room, gym-sokoban's sprite size.
    tile_px: int = 16
    require_think: bool = True


@dataclass(eq=False)  # compared by identity; solve() keys on (player, boxes)
class Room:
    fixed: np.ndarray  # (h, w) int8 of WALL / FLOOR / TARGET
    boxes: frozenset[tuple[int, int]]
    player: tuple[int, int]

    def solved(self) -> bool:
        return all(self.fixed[b] == TARGET for b in self.boxes)


def _carve_topology(rng: np.random.Generator, dim: tuple[int, int]) -> np.ndarray:
    """A random walk inside the border walls carves the floor (about 60% of the inside)."""
    h, w = dim
    fixed = np.full((h, w), WALL, dtype=np.int8)
    wanted = max(4, int(0.6 * (h - 2) * (w - 2)))
    r, c = int(rng.integers(1, h - 1)), int(rng.integers(1, w - 1))
    fixed[r, c] = FLOOR
    direction = ACTIONS[int(rng.integers(4))]
    carved = 1
    for _ in range(20 * h * w):
        if carved >= wanted:
            break
        dr, dc = MOVES[direction]
        if rng.random() < 0.35 or not (1 <= r + dr <= h - 2 and 1 <= c + dc <= w - 2):
            direction = ACTIONS[int(rng.integers(4))]
            continue
        r, c = r + dr, c + dc
        carved += fixed[r, c] == WALL
        fixed[r, c] = FLOOR
    return fixed


def _reverse_play(rng, fixed, targets, player, steps):
    """Walk backwards from the solved room; returns the hardest unsolved state seen."""
    origin = {t: t for t in targets}  # box position -> the target it started on
    boxes = dict(origin)
    best, best_score = None, 1
    for _ in range(steps):
        dr, dc = MOVES[ACTIONS[int(rng.integers(4))]]
        nxt = (player[0] + dr, player[1] + dc)
        if fixed[nxt] == WALL or nxt in boxes:
            continue
        behind = (player[0] - dr, player[1] - dc)
        if behind in boxes and rng.random() < 0.8:
            boxes[player] = boxes.pop(behind)
        player = nxt
        off_target = sum(fixed[b] != TARGET for b in boxes)
        if off_target == 0:
            continue
        score = off_target * sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in boxes.items())
        if score >= best_score:
            best, best_score = Room(fixed, frozenset(boxes), player), score
    return best


def generate_room(
    seed: int, dim: tuple[int, int] = (6, 6), num_boxes: int = 1, reverse_steps: int = 100
) -> Room:
    h, w = dim
    if h < 4 or w < 4 or num_boxes < 1:
        raise ValueError(f"room {dim} with {num_boxes} boxes is too small")
    rng = seeded_rng(seed)
    for _ in range(1000):
        fixed = _carve_topology(rng, dim)
        cells = [tuple(int(x) for x in p) for p in np.argwhere(fixed == FLOOR)]
        if len(cells) < num_boxes + 3:
            continue
        picks = rng.choice(len(cells), size=num_boxes + 1, replace=False)
        targets = [cells[i] for i in picks[:num_boxes]]
        for t in targets:
            fixed[t] = TARGET
        room = _reverse_play(rng, fixed, targets, cells[picks[-1]], reverse_steps)
        if room is not None:
            return room
    raise RuntimeError(f"could not generate a {dim} room with {num_boxes} boxes for seed {seed}")


def room_codes(room: Room) -> np.ndarray:
    """(h, w) indices into _CODES."""
    codes = room.fixed.astype(np.int8).copy()  # wall 0, floor 1, target 2 already match
    for b in room.boxes:
        codes[b] = 4 if room.fixed[b] == TARGET else 3
    codes[room.player] = 6 if room.fixed[room.player] == TARGET else 5
    return codes


def room_text(room: Room) -> str:
    return "\n".join(" ".join(row) for row in _CODE_SYMBOL[room_codes(room)])


@lru_cache(maxsize=8)
def _tiles(px: int) -> np.ndarray:
    """(7, px, px, 3) uint8 sprite per display code: brick wall, sand floor, red target
    ring, wooden box (a frame and a cross; green once on a target), blue player (with
    the target's red centre when standing on one)."""
    yy, xx = np.mgrid[0:px, 0:px]
    centre = (px - 1) / 2
    dist = np.hypot(yy - centre, xx - centre)
    lo, hi = px // 8, px - 1 - px // 8
    inset = (yy >= lo) & (yy <= hi) & (xx >= lo) & (xx <= hi)
    line = max(1, px // 8)
    frame = inset & ((yy < lo + line) | (yy > hi - line) | (xx < lo + line) | (xx > hi - line))
    cross = inset & ((np.abs(yy - xx) < line) | (np.abs(yy + xx - (px - 1)) < line))
    half = max(px // 2, 1)
    mortar = (yy % half == 0) | ((xx + (yy // half) * (half // 2)) % px == 0)
    tiles = np.zeros((7, px, px, 3), dtype=np.uint8)
    tiles[0] = (150, 75, 55)
    tiles[0][mortar] = (95, 85, 80)
    tiles[1:] = (214, 200, 170)
    tiles[2][(dist <= px / 2.8) & (dist >= px / 6)] = (200, 40, 40)
    for code, wood, edge in ((3, (190, 125, 45), (110, 65, 20)), (4, (70, 180, 70), (25, 100, 35))):
        tiles[code][inset] = wood
        tiles[code][frame | cross] = edge
    tiles[5][dist <= px / 2.6] = (40, 70, 200)
    tiles[6][dist <= px / 2.6] = (40, 70, 200)
    tiles[6][dist <= px / 6] = (200, 40, 40)
    return tiles


def room_image(room: Room, tile_px: int = 8) -> np.ndarray:
    codes = room_codes(room)
    h, w = codes.shape
    image = _tiles(tile_px)[codes].transpose(0, 2, 1, 3, 4).reshape(h * tile_px, w * tile_px, 3)
    image.flags.writeable = False  # shared by the observation, the prompts and the samples
    return image


def push(room: Room, action: str) -> tuple[Room, float, bool]:
    """One move; returns the new room, its shaped reward (without the solve bonus) and
    whether the player moved."""
    dr, dc = MOVES[action]
    pr, pc = room.player
    nxt = (pr + dr, pc + dc)
    reward = STEP_REWARD
    if room.fixed[nxt] == WALL:
        return room, reward, False
    boxes = room.boxes
    if nxt in boxes:
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if room.fixed[beyond] == WALL or beyond in boxes:
            return room, reward, False
        boxes = (boxes - {nxt}) | {beyond}
        reward += BOX_ON_TARGET_REWARD * (room.fixed[beyond] == TARGET)
        reward += BOX_OFF_TARGET_REWARD * (room.fixed[nxt] == TARGET)
    return Room(room.fixed, boxes, nxt), reward, True


def solve(room: Room, max_states: int = 200_000) -> list[str] | None:
    """Shortest move sequence (BFS over player x boxes), or None."""
    start = (room.player, room.boxes)
    parents: dict = {start: None}
    queue = deque([start])
    while queue and len(parents) < max_states:
        state = queue.popleft()
        current = Room(room.fixed, state[1], state[0])
        if current.solved():
            path = []
            while parents[state] is not None:
                state, move = parents[state]
                path.append(move)
            return path[::-1]
        for move in ACTIONS:
            nxt_room, _, moved = push(current, move)
            key = (nxt_room.player, nxt_room.boxes)
            if moved and key not in parents:
                parents[key] = (state, move)
                queue.append(key)
    return None


class SokobanEnv:
    @staticmethod
    def instructions_for(config: SokobanConfig) -> str:
        return INSTRUCTIONS

    def __init__(self, config: SokobanConfig):
        self.config = config
        self.room: Room | None = None
        self.steps = 0
        self.done = True

    def _observation(self) -> Observation:
        text = room_text(self.room)
        image = room_image(self.room, self.config.tile_px) if self.config.render_image else None
        return Observation(text=text, image=image, anchor=text)

    def reset(self, seed: int) -> Observation:
        cfg = self.config
        self.room = generate_room(seed, tuple(cfg.dim_room), cfg.num_boxes, cfg.reverse_steps)
        self.steps = 0
        self.done = False
        return self._observation()

    def step(self, text: str) -> tuple[Observation, float, bool, dict]:
        if self.room is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return self._observation(), 0.0, True, make_info(False, self.room.solved(), action=None)
        action = parse_tagged_action(text, ACTIONS, self.config.require_think)
        self.steps += 1
        moved = False
        reward = 0.0
        if action is not None:
            self.room, reward, moved = push(self.room, action)
        won = self.room.solved()
        if won:
            reward += SOLVED_REWARD
        self.done = won or self.steps >= self.config.max_steps
        boxes_on_target = sum(self.room.fixed[b] == TARGET for b in self.room.boxes)
        info = make_info(
            action is not None,
            won,
            action=action,
            action_is_effective=moved,
            boxes_on_target=int(boxes_on_target),
            truncated=self.done and not won,
        )
        return self._observation(), float(reward), self.done, info


register_env("sokoban", SokobanEnv, SokobanConfig)
