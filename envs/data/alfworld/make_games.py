"""Writes the six small hand-made ALFWorld tasks shipped with envs/ (deterministic output).

    python envs/data/alfworld/make_games.py

Each task is an `initial_state.pddl` (the PDDL problem over ALFWorld's own domain) and
a `traj_data.json` (task type and targets), in the layout `alfworld-download` produces:
json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/. The game files
(game.tw-pddl) are not shipped: envs/alfworld.py makes them with the package's
`alfworld-generate`. Three small rooms, one task per task type: four training tasks in
the study and the kitchen, a validation task in the kitchen (seen) and one in the
living room (unseen).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent / "json_2.1.1"

# The domain's actions name these types; every problem declares them.
DOMAIN_OTYPES = ("KnifeType", "ButterKnifeType")
DOMAIN_RTYPES = ("SinkBasinType", "MicrowaveType", "FridgeType")

# room -> [(receptacle type, openable, [(object type, properties)])]; every receptacle
# stands at its own location. Properties are unary domain predicates.
ROOMS = {
    "study": [
        ("Desk", False, [("Pencil", ("pickupable",)), ("CD", ("pickupable",))]),
        ("Drawer", True, [("KeyChain", ("pickupable",))]),
        ("Drawer", True, [("CD", ("pickupable",))]),
        ("Shelf", False, [("Vase", ("pickupable",))]),
        ("Bed", False, [("Pillow", ("pickupable",))]),
    ],
    "kitchen": [
        ("CounterTop", False, [("Apple", ("pickupable", "heatable", "coolable")), ("Mug", ("pickupable",))]),
        ("Cabinet", True, [("Plate", ("pickupable", "cleanable"))]),
        ("Cabinet", True, []),
        ("Fridge", True, [("Tomato", ("pickupable", "coolable", "heatable"))]),
        ("Microwave", True, []),
        ("SinkBasin", False, [("Spoon", ("pickupable", "cleanable"))]),
        ("DiningTable", False, [("Bread", ("pickupable", "heatable", "coolable"))]),
    ],
    "livingroom": [
        ("Sofa", False, [("Pillow", ("pickupable",)), ("RemoteControl", ("pickupable",))]),
        ("CoffeeTable", False, [("Book", ("pickupable",)), ("Newspaper", ("pickupable",))]),
        ("SideTable", False, [("DeskLamp", ("toggleable",))]),
        ("Drawer", True, [("Book", ("pickupable",))]),
    ],
}
SCENES = {"study": 901, "kitchen": 902, "livingroom": 903}

# (split, task type, room, object target, parent target, toggle target)
TASKS = [
    ("train", "pick_and_place_simple", "study", "Pencil", "Shelf", ""),
    ("train", "pick_two_obj_and_place", "study", "CD", "Bed", ""),
    ("train", "pick_clean_then_place_in_recep", "kitchen", "Plate", "DiningTable", ""),
    ("train", "pick_heat_then_place_in_recep", "kitchen", "Apple", "CounterTop", ""),
    ("valid_seen", "pick_cool_then_place_in_recep", "kitchen", "Tomato", "DiningTable", ""),
    ("valid_unseen", "look_at_obj_in_light", "livingroom", "Book", "", "DeskLamp"),
]


def mangled(name: str, index: int, height: int) -> str:
    """An ALFRED-style id, `Name|+0i.00|+0h.50|-01.25` spelled with _bar_/_plus_/_dot_."""
    return f"{name}_bar__plus_0{index}_dot_00_bar__plus_0{height}_dot_50_bar__minus_01_dot_25"


def receptacle_id(rtype: str, index: int) -> str:
    if rtype == "SinkBasin":  # ALFRED names a sink's basin after the sink: Sink|...|SinkBasin
        return mangled("Sink", index, 0) + "_bar_SinkBasin"
    return mangled(rtype, index, 0)


def room_facts(room: str) -> tuple[list[str], ...]:
    """(objects, receptacles, locations, otypes, rtypes) declarations and the init facts."""
    objects, receptacles, locations, init = [], [], ["loc_bar_0_bar_0_bar_0_bar_0"], []
    otypes, rtypes = set(DOMAIN_OTYPES), set(DOMAIN_RTYPES)
    for r_index, (rtype, openable, contents) in enumerate(ROOMS[room], start=1):
        rid, loc = receptacle_id(rtype, r_index), f"loc_bar_{r_index}_bar_{r_index}_bar_1_bar_45"
        receptacles.append(rid)
        locations.append(loc)
        rtypes.add(f"{rtype}Type")
        init += [f"(receptacleType {rid} {rtype}Type)", f"(receptacleAtLocation {rid} {loc})"]
        if openable:
            init.append(f"(openable {rid})")
        for o_index, (otype, properties) in enumerate(contents, start=1):
            oid = mangled(otype, r_index, o_index)
            objects.append(oid)
            otypes.add(f"{otype}Type")
            init += [f"(objectType {oid} {otype}Type)", f"(inReceptacle {oid} {rid})",
                     f"(objectAtLocation {oid} {loc})"]
            init += [f"({p} {oid})" for p in properties]
    movable = sorted({t for _, _, contents in ROOMS[room] for t, props in contents if "pickupable" in props})
    init += [f"(canContain {rt} {ot}Type)" for rt in sorted(rtypes) for ot in movable]
    init.append("(atLocation agent1 loc_bar_0_bar_0_bar_0_bar_0)")
    return objects, receptacles, locations, sorted(otypes), sorted(rtypes), init


GOALS = {
    "pick_and_place_simple": "(exists (?r - receptacle) (exists (?o - object) (and (inReceptacle ?o ?r) "
    "(objectType ?o {obj}Type) (receptacleType ?r {recep}Type))))",
    "pick_two_obj_and_place": "(exists (?r - receptacle) (exists (?o1 - object) (and (objectType ?o1 {obj}Type) "
    "(receptacleType ?r {recep}Type) (inReceptacle ?o1 ?r) (exists (?o2 - object) (and (not (= ?o1 ?o2)) "
    "(objectType ?o2 {obj}Type) (inReceptacle ?o2 ?r))))))",
    "look_at_obj_in_light": "(and (exists (?ot - object ?r - receptacle ?a - agent ?l - location) "
    "(and (objectType ?ot {toggle}Type) (toggleable ?ot) (isToggled ?ot) (receptacleAtLocation ?r ?l) "
    "(atLocation ?a ?l) (inReceptacle ?ot ?r))) (exists (?o - object ?a - agent) "
    "(and (objectType ?o {obj}Type) (holds ?a ?o))))",
}
for _kind, _state in (("clean", "isClean"), ("heat", "isHot"), ("cool", "isCool")):
    _able = {"clean": "cleanable", "heat": "heatable", "cool": "coolable"}[_kind]
    GOALS[f"pick_{_kind}_then_place_in_recep"] = (
        "(exists (?r - receptacle) (exists (?o - object) (and (" + _able + " ?o) (objectType ?o {obj}Type) "
        "(receptacleType ?r {recep}Type) (" + _state + " ?o) (inReceptacle ?o ?r))))"
    )


def problem(trial: str, task_type: str, room: str, obj: str, recep: str, toggle: str) -> str:
    objects, receptacles, locations, otypes, rtypes, init = room_facts(room)
    declare = (["agent1 - agent"] + [f"{o} - object" for o in objects] + [f"{t} - otype" for t in otypes]
               + [f"{t} - rtype" for t in rtypes] + [f"{r} - receptacle" for r in receptacles]
               + [f"{loc} - location" for loc in locations])
    goal = GOALS[task_type].format(obj=obj, recep=recep, toggle=toggle)
    lines = [f"(define (problem plan_{trial})", "(:domain alfred)", "(:objects"]
    lines += [f"    {d}" for d in declare] + [")", "(:init"] + [f"    {f}" for f in init] + [")"]
    lines += [f"(:goal {goal})", ")"]
    return "\n".join(lines) + "\n"


def traj_data(trial: str, task_type: str, room: str, obj: str, recep: str, toggle: str) -> dict:
    return {
        "task_id": trial,
        "task_type": task_type,
        "scene": {"scene_num": SCENES[room]},
        "pddl_params": {"object_target": obj, "parent_target": recep, "toggle_target": toggle,
                        "mrecep_target": "", "object_sliced": False},
        "turk_annotations": {"anns": []},
    }


def main() -> None:
    for n, (split, task_type, room, obj, recep, toggle) in enumerate(TASKS, start=1):
        trial = f"trial_T20240101_000000_00000{n}"
        folder = HERE / split / f"{task_type}-{obj}-None-{recep or toggle}-{SCENES[room]}" / trial
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "initial_state.pddl").write_text(problem(trial, task_type, room, obj, recep, toggle))
        data = traj_data(trial, task_type, room, obj, recep, toggle)
        (folder / "traj_data.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
