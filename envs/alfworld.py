"""ALFWorld: household tasks in TextWorld, played by the real `alfworld` package.

A game is one ALFRED task (a PDDL problem over ALFWorld's domain, `game.tw-pddl`). The
copy plays it through TextWorld's PDDL engine with the wrappers ALFWorld's own
`AlfredTWEnv` puts on it (object names demangled to `cabinet 1`, no shuffling), and
the game list of a split is what `AlfredTWEnv.collect_game_files` finds (solvable
games of the six task types, no movable or sliced ones), sorted.

Data: `data_dir` holds `json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/`
with `initial_state.pddl` and `traj_data.json` (the layout `alfworld-download`
produces). Where a trial has no `game.tw-pddl` yet, the package's `alfworld-generate`
makes the games into `games_dir` on the first reset (one process at a time).

Seeds: training seed s plays train game s % n; validation seed VALIDATION_SEED_OFFSET + i
plays game i % n of `eval_split` (valid_seen: in distribution, valid_unseen: out of
distribution). Copies of a group share a seed, so they play the same game.

The model writes one admissible command inside <action> </action> (after a <think>
block when require_think). Anything else is an invalid action: a no-op, reward 0, one
of the max_steps (50). Reward 10 when the task is done (won, the episode ends).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from envs.base import VALIDATION_SEED_OFFSET, Observation, make_info
from envs.projection import parse_tagged_action
from envs.registry import register_env

DEFAULT_DATA_DIR = str(Path(__file__).parent / "data" / "alfworld")
JSON_DIR = "json_2.1.1"
GAME_FILE = "game.tw-pddl"
EVAL_SPLITS = ("valid_seen", "valid_unseen")
WON_REWARD = 10.0
INSTALL_HINT = "ALFWorld needs the optional extra: pip install 'megatron-agent[alfworld]' (docs/environments.md)"

# ALFWorld's task type (traj_data.json) -> the name success is reported under.
TASK_TYPES = {
    "pick_and_place_simple": "pick_and_place",
    "pick_two_obj_and_place": "pick_two_obj",
    "look_at_obj_in_light": "look_at_obj_in_light",
    "pick_clean_then_place_in_recep": "pick_clean_then_place",
    "pick_heat_then_place_in_recep": "pick_heat_then_place",
    "pick_cool_then_place_in_recep": "pick_cool_then_place",
}
HIDDEN_COMMANDS = ("help",)  # admissible in TextWorld, never useful to the agent

INSTRUCTIONS = (
    "You are a household robot in a text-based home (ALFWorld). Carry out the task you are given. "
    "Each turn you read the result of your last action and the list of admissible actions.\n"
    "Think step by step inside <think> </think>, then write exactly one admissible action, "
    "copied as listed, inside <action> </action>, for example <action>go to cabinet 1</action>."
)


@dataclass
class AlfworldConfig:
    data_dir: str = DEFAULT_DATA_DIR
    # Where missing game files are generated; "" -> a folder per data_dir under ~/.cache.
    games_dir: str = ""
    eval_split: str = "valid_seen"
    max_steps: int = 50
    require_think: bool = True

    def __post_init__(self):
        if self.eval_split not in EVAL_SPLITS:
            raise ValueError(f"eval_split must be one of {EVAL_SPLITS}, got {self.eval_split!r}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")


# -- the data: games on disk --------------------------------------------------------


def trial_dirs(json_root: Path) -> list[Path]:
    """Every trial (a folder with traj_data.json) under a json_2.1.1 folder, sorted."""
    return sorted(p.parent for p in json_root.rglob("traj_data.json"))


def playable(trial: Path) -> bool:
    return "movable" not in str(trial) and "Sliced" not in str(trial)


def default_games_dir(data_dir: str) -> Path:
    digest = hashlib.sha1(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "megatron-agent" / "alfworld-games" / digest


def missing_games(src_root: Path, out_root: Path) -> list[Path]:
    return [t for t in trial_dirs(src_root)
            if playable(t) and not (out_root / t.relative_to(src_root) / GAME_FILE).exists()]


def generate_games(src_root: Path, out_root: Path) -> None:
    """Run the package's `alfworld-generate` over every trial of src_root.

    Its `--end` defaults to -1, a slice end that skips the last trial: pass the count.
    The task sentence is drawn from `random`, seeded here so the games are reproducible.
    """
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    script = Path(sysconfig.get_path("scripts")) / "alfworld-generate"
    if not script.exists():
        raise FileNotFoundError(f"{script} is missing; {INSTALL_HINT}")
    argv = ["alfworld-generate", "--data_path", str(src_root), "--save_path", str(out_root),
            "--domain", ALFRED_PDDL_PATH, "--grammar", ALFRED_TWL2_PATH,
            "--end", str(len(trial_dirs(src_root)))]
    run = ("import random, runpy, sys; random.seed(0); sys.argv = " + repr(argv)
           + f"; runpy.run_path({str(script)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"alfworld-generate failed ({done.returncode}):\n{done.stderr[-4000:]}")


@lru_cache(maxsize=8)
def games_root(data_dir: str, games_dir: str) -> Path:
    """The json_2.1.1 folder to play from: data_dir's own when every trial has its game,
    else games_dir's, generated first where games are missing."""
    src_root = Path(data_dir) / JSON_DIR
    if not missing_games(src_root, src_root):
        return src_root
    out_root = Path(games_dir or default_games_dir(data_dir)) / JSON_DIR
    out_root.mkdir(parents=True, exist_ok=True)
    with open(out_root.parent / ".generate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # worker processes of one run share the folder
        if missing_games(src_root, out_root):
            generate_games(src_root, out_root)
    return out_root


@lru_cache(maxsize=16)
def split_games(root: str, split: str) -> tuple[str, ...]:
    """The solvable games of a split, as `AlfredTWEnv.collect_game_files` finds them, sorted."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    train_eval = {"train": "train", "valid_seen": "eval_in_distribution",
                  "valid_unseen": "eval_out_of_distribution"}[split]
    config = {
        "env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6]},
        "dataset": {"data_path": f"{root}/train", "eval_id_data_path": f"{root}/valid_seen",
                    "eval_ood_data_path": f"{root}/valid_unseen", "num_train_games": -1, "num_eval_games": -1},
    }
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        games = AlfredTWEnv(config, train_eval=train_eval).game_files
    if not games:
        raise FileNotFoundError(f"no solvable ALFWorld games in {root}/{split}")
    return tuple(sorted(games))


def game_for_seed(config: AlfworldConfig, seed: int) -> str:
    """The game file a seed plays (the same in every process)."""
    root = str(games_root(config.data_dir, config.games_dir))
    seed = int(seed)
    if seed >= VALIDATION_SEED_OFFSET:
        games = split_games(root, config.eval_split)
        return games[(seed - VALIDATION_SEED_OFFSET) % len(games)]
    games = split_games(root, "train")
    return games[seed % len(games)]


def task_type_of(game_file: str) -> str:
    traj = json.loads((Path(game_file).parent / "traj_data.json").read_text())
    return TASK_TYPES.get(traj["task_type"], traj["task_type"])


# -- one game in TextWorld ----------------------------------------------------------


def start_game(game_file: str):
    """A TextWorld PDDL env on the game, wrapped as AlfredTWEnv wraps its games."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    from textworld.envs import PddlEnv

    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
    env.load(game_file)
    return env


def split_intro(feedback: str) -> tuple[str, str]:
    """The first feedback is `-= Welcome ... =-`, the room, then `Your task is to: ...`:
    returns (task, room)."""
    body = feedback.split("=-", 1)[-1]
    room, _, task = body.partition("Your task is to:")
    return task.strip(), room.strip()


def observation_text(task: str, feedback: str, commands: tuple[str, ...]) -> str:
    return (f"Your task is to: {task}\n{feedback.strip()}\n"
            f"Admissible actions: [{', '.join(commands)}]")


class AlfworldEnv:
    @staticmethod
    def instructions_for(config: AlfworldConfig) -> str:
        return INSTRUCTIONS

    def __init__(self, config: AlfworldConfig):
        if importlib.util.find_spec("alfworld") is None or importlib.util.find_spec("textworld") is None:
            raise ImportError(INSTALL_HINT)
        if not (Path(config.data_dir) / JSON_DIR).is_dir():
            raise FileNotFoundError(f"data_dir {config.data_dir!r} has no {JSON_DIR}/ folder "
                                    "(the layout alfworld-download produces)")
        self.config = config
        self.game = None
        self.game_file = ""
        self.task = self.task_type = self.game_name = self.feedback = ""
        self.commands: tuple[str, ...] = ()
        self.won = False
        self.steps = 0
        self.done = True

    def _observation(self) -> Observation:
        text = observation_text(self.task, self.feedback, self.commands)
        return Observation(text=text, image=None, anchor=text)

    def _take(self, state) -> None:
        self.feedback = state["feedback"]
        self.commands = tuple(c for c in state["admissible_commands"] if c not in HIDDEN_COMMANDS)
        self.won = bool(state["won"])

    def reset(self, seed: int) -> Observation:
        game_file = game_for_seed(self.config, seed)
        if game_file != self.game_file:
            if self.game is not None:
                self.game.close()
            self.game, self.game_file = start_game(game_file), game_file
            self.task_type = task_type_of(game_file)
            self.game_name = str(Path(game_file).parent.relative_to(Path(game_file).parents[3]))
        state = self.game.reset()
        self.task, room = split_intro(state["feedback"])
        self._take(state)
        self.feedback = room
        self.steps = 0
        self.done = False
        return self._observation()

    def step(self, text: str) -> tuple[Observation, float, bool, dict]:
        if self.game is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return self._observation(), 0.0, True, self._info(None)
        action = parse_tagged_action(text, self.commands, self.config.require_think)
        self.steps += 1
        if action is not None:
            state, _, _ = self.game.step(action)
            self._take(state)
        self.done = self.won or self.steps >= self.config.max_steps
        return self._observation(), WON_REWARD if self.won else 0.0, self.done, self._info(action)

    def _info(self, action: str | None) -> dict:
        return make_info(
            action is not None,
            self.won,
            action=action,
            task_type=self.task_type,
            task=self.task,
            game=self.game_name,
            admissible_actions=list(self.commands),
            truncated=self.done and not self.won,
        )


register_env("alfworld", AlfworldEnv, AlfworldConfig)
