"""A simulated rollout engine and an ALFWorld-sized text env, for benchmarks of the CPU
around generation (bench/leader_cpu.py).

    urls, engine = start_engine(model_dir, ports=4, latency_ms=20, actions="household")

The engine is one process on 127.0.0.1 serving `ports` HTTP servers (one URL each, so
every rollout worker has engines of its own) with the part of SGLang's protocol that
rollout/engine_client.py uses: GET /health, POST /generate (input_ids, sampling_params,
rid, image_data, return_logprob), answered as SGLang does (rollout/engine_responses.py):
per prompt `text`, `output_ids` and `meta_info` (`output_token_logprobs`, `finish_reason`,
`weight_version`, `prompt_tokens`, for an image request the prompt expanded by its images'
token counts, which it computes with the model's image processor). It answers each call
after `latency_ms` (a sleep: no CPU). A response is `<think>` and English reasoning,
then `</think><action>...</action>` and the end token, 200-500 tokens (at most the
request's max_new_tokens), its length, text and action drawn from the request's
sampling seed, so every run sees the same responses. The action is one of an env's
commands (`ACTION_SETS`), which the env accepts part of the time.

`household`: a bench-only env with ALFWorld's kind of text (a room of receptacles and
objects, the task, the admissible commands: 1-1.4 kB an observation, varying each step).
It registers at import of this module; a Ray worker imports it by the runtime_env's
`worker_process_setup_hook` ("simulated_engine.register_envs"), with this folder on its
PYTHONPATH: envs/registry.py finds only the envs of its built-in list.

Run alone for a look at the env's text and the engine's answers:
    python bench/simulated_engine.py --demo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(BENCH_DIR.parent), str(BENCH_DIR)) if p not in sys.path]

from envs import Observation, make_info, register_env  # noqa: E402
from envs.base import seeded_rng  # noqa: E402
from envs.projection import action_block  # noqa: E402

# -- an ALFWorld-sized text env ------------------------------------------------------

RECEPTACLES = ("armchair", "bathtubbasin", "bed", "cabinet", "coffeemachine", "countertop", "desk",
               "diningtable", "drawer", "dresser", "fridge", "garbagecan", "handtowelholder", "laundryhamper",
               "microwave", "ottoman", "safe", "shelf", "sidetable", "sinkbasin", "sofa", "stoveburner",
               "toaster", "toilet", "towelholder", "tvstand")
OPENABLE = ("cabinet", "drawer", "fridge", "microwave", "safe", "laundryhamper")
OBJECTS = ("alarmclock", "apple", "book", "bowl", "bread", "butterknife", "candle", "cd", "cellphone", "cloth",
           "creditcard", "cup", "dishsponge", "egg", "fork", "kettle", "keychain", "knife", "ladle", "lettuce",
           "mug", "newspaper", "pan", "pen", "pencil", "peppershaker", "pillow", "plate", "pot", "potato",
           "remotecontrol", "saltshaker", "soapbar", "spatula", "spoon", "spraybottle", "statue", "tomato",
           "vase", "watch")
TASKS = ("put a clean {o} in {r}", "heat some {o} and put it in {r}", "cool some {o} and put it in {r}",
         "put two {o} in {r}", "examine the {o} with the desklamp", "put some {o} on {r}")
HOUSEHOLD_INSTRUCTIONS = (
    "You are a household robot in a text-based home (ALFWorld). Carry out the task you are given. "
    "Each turn you read the result of your last action and the list of admissible actions.\n"
    "Think step by step inside <think> </think>, then write exactly one admissible action, "
    "copied as listed, inside <action> </action>, for example <action>go to cabinet 1</action>.")


@dataclass
class HouseholdConfig:
    max_steps: int = 50
    end_probability: float = 1 / 12  # per step; drawn from the seed, the step and the action
    receptacle_kinds: int = 20  # of RECEPTACLES in a room (each 1-4 times): the text's size


def _listing(names: list[str]) -> str:
    if not names:
        return "nothing"
    items = [f"a {n}" for n in names]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


class HouseholdEnv:
    """ALFWorld's kind of episode: go to receptacles, open them, take and put objects.
    Accepts an action that is one of the admissible commands of the moment."""

    def __init__(self, config: HouseholdConfig):
        self.config = config

    @staticmethod
    def instructions_for(config: HouseholdConfig) -> str:
        return HOUSEHOLD_INSTRUCTIONS

    def reset(self, seed: int) -> Observation:
        rng = seeded_rng(seed)
        self.seed, self.step_index, self.location, self.holding = int(seed), 0, None, None
        kinds = sorted(rng.choice(len(RECEPTACLES), self.config.receptacle_kinds, replace=False))
        self.receptacles = [f"{RECEPTACLES[k]} {n}" for k in kinds for n in range(int(rng.integers(1, 5)), 0, -1)]
        self.opened: set[str] = set()
        self.contents = {r: [f"{OBJECTS[o]} {int(rng.integers(1, 4))}"
                             for o in rng.choice(len(OBJECTS), int(rng.integers(0, 4)), replace=False)]
                         for r in self.receptacles}
        goal = self.receptacles[int(rng.integers(len(self.receptacles)))].rsplit(" ", 1)[0]
        self.task = TASKS[int(rng.integers(len(TASKS)))].format(o=OBJECTS[int(rng.integers(len(OBJECTS)))], r=goal)
        text = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, "
                f"you see {_listing(self.receptacles)}.")
        return self._observation(text)

    def admissible(self) -> list[str]:
        out = [f"go to {r}" for r in self.receptacles if r != self.location]
        here = self.location
        if here is not None:
            kind = here.rsplit(" ", 1)[0]
            if kind in OPENABLE:
                out.append(f"close {here}" if here in self.opened else f"open {here}")
            if kind not in OPENABLE or here in self.opened:
                if self.holding is None:
                    out += [f"take {o} from {here}" for o in self.contents[here]]
                else:
                    out.append(f"move {self.holding} to {here}")
            out.append(f"examine {here}")
        return out + ["inventory", "look"]

    def _observation(self, text: str) -> Observation:
        full = f"{text}\nYour task is to: {self.task}.\nAdmissible actions: [{', '.join(self.admissible())}]"
        return Observation(text=full, anchor=full)

    def step(self, text: str):
        action = action_block(text)
        valid = action is not None and action.strip() in self.admissible()
        result = self._act(action.strip()) if valid else "Nothing happens."
        draw = seeded_rng(zlib.crc32(f"{self.seed}-{self.step_index}-{action}".encode())).random(2)
        self.step_index += 1
        won = bool(valid and draw[0] < self.config.end_probability)
        done = won or bool(draw[1] < self.config.end_probability) or self.step_index >= self.config.max_steps
        return self._observation(result), 10.0 if won else 0.0, done, make_info(valid, won)

    def _act(self, action: str) -> str:
        here = self.location
        if action.startswith("go to "):
            self.location = here = action[len("go to "):]
            if here.rsplit(" ", 1)[0] in OPENABLE and here not in self.opened:
                return f"You arrive at {here}. The {here} is closed."
            return f"You arrive at {here}. On the {here}, you see {_listing(self.contents[here])}."
        if action.startswith("open "):
            self.opened.add(here)
            return f"You open the {here}. The {here} is open. In it, you see {_listing(self.contents[here])}."
        if action.startswith("close "):
            self.opened.discard(here)
            return f"You close the {here}."
        if action.startswith("take "):
            self.holding = action[len("take "):].split(" from ")[0]
            self.contents[here].remove(self.holding)
            return f"You pick up the {self.holding} from the {here}."
        if action.startswith("move "):
            self.contents[here].append(self.holding)
            moved, self.holding = self.holding, None
            return f"You move the {moved} to the {here}."
        if action.startswith("examine "):
            return f"On the {here}, you see {_listing(self.contents[here])}."
        if action == "inventory":
            return f"You are carrying: {'a ' + self.holding if self.holding else 'nothing'}."
        where = f"You are facing the {here}. " if here else "You are in the middle of a room. "
        return where + f"Looking quickly around you, you see {_listing(self.receptacles)}."


def register_envs() -> None:
    """The bench's envs in this process's registry (a Ray worker's setup hook)."""
    register_env("bench_household", HouseholdEnv, HouseholdConfig)


register_envs()

# -- the engine ----------------------------------------------------------------------

ACTION_SETS = {
    # Receptacles 1-4 of every kind: a room has some of them (a command the env accepts
    # about a third of the time), plus "look", which it always accepts.
    "household": tuple(f"go to {r} {n}" for r in RECEPTACLES for n in range(1, 5)) + ("look",) * 8,
    "sokoban": ("up", "down", "left", "right"),
}
REASONING = (
    "I should look at what the room holds before I decide where to go. The task names an object and a "
    "receptacle, so first I need to find the object. Objects like this are usually kept on a countertop, "
    "in a cabinet or in a drawer, so those are the places to check first. I have not opened the cabinets yet, "
    "and a closed cabinet hides what is inside it. If the object is not on the countertop I will try the "
    "drawers one by one. Once I hold the object I need to clean, heat or cool it as the task says, then carry "
    "it to the receptacle and put it there. Going back to a place I already checked wastes a step, so I will "
    "remember which places were empty. The last action did not change much, which means I should try a "
    "different receptacle now rather than repeat myself. The list of admissible actions tells me exactly what "
    "I may write, so I will copy one of them as it is listed. ")


class Engine:
    """What every port of the simulated engine shares: the tokenizer (and a VLM's image
    processor), the reasoning's token ids and the actions' closing ids."""

    def __init__(self, model_dir: str, latency_ms: float, actions: str, min_tokens: int, max_tokens: int):
        from transformers import AutoTokenizer

        from rollout.vision import load_image_processor

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor = load_image_processor(model_dir)
        self.pad_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>") if self.processor else None
        self.latency_s, self.min_tokens, self.max_tokens = latency_ms / 1000, min_tokens, max_tokens
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        self.think = encode("<think>")
        self.reasoning = np.array(encode(REASONING * 4), dtype=np.int64)
        self.endings = [encode(f"</think><action>{a}</action>") + [self.tokenizer.eos_token_id]
                        for a in ACTION_SETS[actions]]
        self.decode_lock = threading.Lock()  # a fast tokenizer is not to be shared across threads

    def answer(self, ids: list[int], params: dict, images: list | None) -> dict:
        rng = np.random.default_rng(int(params.get("sampling_seed", 0)))
        n = min(int(rng.integers(self.min_tokens, self.max_tokens + 1)), int(params.get("max_new_tokens", 1 << 30)))
        ending = self.endings[int(rng.integers(len(self.endings)))]
        fill = max(n - len(self.think) - len(ending), 0)
        start = int(rng.integers(len(self.reasoning) - fill))
        out = (self.think + self.reasoning[start:start + fill].tolist() + ending)[-n:] if n else []
        logprobs = (-rng.exponential(0.4, len(out))).tolist()
        with self.decode_lock:
            text = self.tokenizer.decode(out, skip_special_tokens=True)
        meta = {"prompt_tokens": self.prompt_tokens(ids, images), "completion_tokens": len(out),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, out)],
                "finish_reason": {"type": "stop", "matched": out[-1]} if out else {"type": "length", "length": 0},
                "weight_version": "default"}
        return {"text": text, "output_ids": out, "meta_info": meta}

    def prompt_tokens(self, ids: list[int], images: list | None) -> int:
        """The prompt's length with each image pad repeated its image's token count."""
        if not images:
            return len(ids)
        from rollout.vision import decode_image_data, image_token_counts, merge_size, process_images

        _, grids = process_images(self.processor, [decode_image_data(item) for item in images])
        counts = image_token_counts(grids, merge_size(self.processor))
        return len(ids) - sum(1 for t in ids if t == self.pad_id) + sum(counts)


def handler_for(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # as SGLang's server (uvicorn) and rollout/engine_http.py

        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, payload) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": f"{self.path} is not served by the simulated engine"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/generate":
                self._send(404, {"error": f"{self.path} is not served by the simulated engine"})
                return
            ids = body["input_ids"]
            params = body["sampling_params"]
            params = params if isinstance(params, list) else [params] * len(ids)
            images = body.get("image_data") or [None] * len(ids)
            answers = [engine.answer(i, p, im) for i, p, im in zip(ids, params, images)]
            time.sleep(engine.latency_s)
            self._send(200, answers)

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the socket's backlog: hundreds of requests connect at once


def serve(args) -> None:
    engine = Engine(args.model, args.latency_ms, args.actions, args.min_tokens, args.max_tokens)
    servers = [Server(("127.0.0.1", 0), handler_for(engine)) for _ in range(args.ports)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print(json.dumps({"ports": [s.server_address[1] for s in servers]}), flush=True)
    parent = os.getppid()
    while os.getppid() == parent:  # ends with the benchmark that started it
        time.sleep(0.5)


def start_engine(model_dir: str, *, ports: int, latency_ms: float = 20.0, actions: str = "household",
                 min_tokens: int = 200, max_tokens: int = 500) -> tuple[list[str], subprocess.Popen]:
    """Start the simulated engine process; (its URLs, the process: terminate it at the end)."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--model", str(model_dir),
                             "--ports", str(ports), "--latency-ms", str(latency_ms), "--actions", actions,
                             "--min-tokens", str(min_tokens), "--max-tokens", str(max_tokens)],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"the simulated engine exited with {proc.returncode} before it served")
    return [f"http://127.0.0.1:{p}" for p in json.loads(line)["ports"]], proc


def demo() -> None:
    import tempfile

    from megatron_agent.models.tiny import write_tiny_model
    from rollout.engine_client import EngineClient

    env = HouseholdEnv(HouseholdConfig())
    obs = env.reset(3)
    print(f"reset ({len(obs.text)} B):\n{obs.text}\n")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model("qwen3", Path(tmp) / "model", tokenizer="bpe")
        urls, proc = start_engine(str(model), ports=1)
        try:
            client = EngineClient(urls)
            out = client.generate([[1, 2, 3]], {"max_new_tokens": 512, "sampling_seed": 7})[0]
            obs, reward, done, info = env.step(out.text)
            print(f"response ({len(out.output_ids)} tokens): {out.text[-120:]!r}\nvalid: {info['is_action_valid']}"
                  f"\nnext ({len(obs.text)} B):\n{obs.text}")
            client.close()
        finally:
            proc.terminate()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="an HF model directory (its tokenizer; a VLM's image processor)")
    ap.add_argument("--ports", type=int, default=1)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--actions", choices=sorted(ACTION_SETS), default="household")
    ap.add_argument("--min-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=500)
    ap.add_argument("--demo", action="store_true", help="print an observation and an answer, then exit")
    cli = ap.parse_args()
    demo() if cli.demo else serve(cli)
