"""The averager's and the matchmaking's mixins keep their own state in the instance's
``__dict__`` under names of their choosing (they cannot extend hivemind's ``__init__``). A name
that is also an attribute of the class (a method of another mixin) shadows it on that instance:
``engine.serving`` once kept its tasks under ``_serving``, the name of the update server's
semaphore method, and every newcomer's update download failed with "'set' object is not
callable" after the averager's first round (``tests/integration/test_slow_joiner.py``). This
reads every such name from the source and holds that none names a class attribute."""

from __future__ import annotations

import re
from pathlib import Path

from engine.averager import ExactAverager
from engine.matchmaking import RoundMatchmaking, RoundPotentialLeaders

REPO = Path(__file__).resolve().parents[2]
STATE = re.compile(r"""__dict__(?:\.(?:get|setdefault)\(\s*|\[)["'](\w+)["']""")


def state_names() -> dict[str, list[str]]:
    """Every ``__dict__`` key a module of ``engine`` reads or writes, with where (a ``pop`` is
    left out: ``round_matchmaking`` pops hivemind's instance values so that its properties of
    the same names take over)."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "engine").glob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in STATE.findall(line):
                found.setdefault(name, []).append(f"{path.relative_to(REPO)}:{number}")
    return found


def test_the_walk_reads_the_mixins_state() -> None:
    names = state_names()
    assert {"_update_serving", "_background_serving", "_start_sent", "_bulk_server"} <= set(names)


def test_no_mixin_keeps_state_under_a_name_the_class_has_for_something_else() -> None:
    names = state_names()
    for cls in (ExactAverager, RoundMatchmaking, RoundPotentialLeaders):
        shadowed = {name: where for name, where in names.items() if hasattr(cls, name)}
        assert not shadowed, f"{cls.__name__}: instance state shadows class attributes: {shadowed}"


def test_the_check_sees_a_shadowing_name() -> None:
    # the bug this guards against, as the check would have seen it
    assert hasattr(ExactAverager, "_serving")
