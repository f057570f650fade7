"""The private hivemind members we rely on (``engine.hivemind_private``) are still there and
still behave as we use them; and our packages use no private hivemind member not listed.

Fails on a hivemind upgrade that renames or moves one of them, changes an overridden method's
parameters, stops calling an override, or sets an attribute elsewhere. Reads sources and
class objects only: no DHT, no averager process."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections import deque
from pathlib import Path
from types import ModuleType
from typing import Any

import hivemind
import pytest
import torch

from engine.hivemind_private import HIVEMIND_VERSION, MIRRORED_KINDS, PRIVATE_USES, PrivateUse

REPO_ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("protocol", "engine", "relay", "peer", "coordinator", "swarmtrain", "benchmarks")

NOT_HIVEMIND: dict[tuple[str, str], str] = {
    ("swarmtrain/lifetime.py", "os._exit"): "the standard library's documented exit without cleanup",
    ("peer/boot/worker.py", "os._exit"): "the standard library's documented exit without cleanup",
    ("relay/splicer.py", "reader._buffer"): "asyncio.StreamReader's buffer, taken whole at a splice's hand-over "
    "(no public call takes it without letting the reader resume its transport); "
    "tests/integration/test_splicer.py sends bytes that wait there",
}
"""Private attribute accesses on things other than ``self`` that are not hivemind's, with why."""


def resolve(dotted: str) -> Any:
    """A module, or an attribute of one, by dotted path (the longest importable module prefix)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def function_of(owner: Any, name: str) -> Any:
    """The plain function ``owner.name`` (unwrapping classmethod/staticmethod), without binding."""
    found = inspect.getattr_static(owner, name)
    return getattr(found, "__func__", found)


def parameter_names(function: Any) -> tuple[str, ...]:
    names = tuple(inspect.signature(function).parameters)
    return names[1:] if names and names[0] in ("self", "cls") else names


def entry_id(use: PrivateUse) -> str:
    return f"{use.owner.rsplit('.', 1)[-1]}.{use.name}"


def test_hivemind_is_the_version_the_registry_was_read_from() -> None:
    assert hivemind.__version__ == HIVEMIND_VERSION, (
        f"hivemind {hivemind.__version__} is installed but engine/hivemind_private.py was read from "
        f"{HIVEMIND_VERSION}: re-read every entry against the new source, then bump HIVEMIND_VERSION"
    )


def test_registry_entries_are_well_formed() -> None:
    assert len({(u.owner, u.name, u.kind) for u in PRIVATE_USES}) == len(PRIVATE_USES), "duplicate entries"
    for use in PRIVATE_USES:
        assert use.owner.startswith("hivemind."), use
        assert use.name.startswith("_") and not use.name.endswith("__"), use
        assert use.why and re.search(r"\.py\b", use.used_in), use
        is_method = "method" in use.kind
        assert is_method or use.kind.startswith("instance attribute") or use.kind in MIRRORED_KINDS, use
        assert is_method or use.evidence, f"{entry_id(use)}: attributes and conventions need evidence"
        assert use.params is None or is_method, use


@pytest.mark.parametrize("use", PRIVATE_USES, ids=entry_id)
def test_private_member_is_still_what_we_rely_on(use: PrivateUse) -> None:
    owner = resolve(use.owner)
    if "method" in use.kind:
        function = function_of(owner, use.name)
        assert inspect.isfunction(function), f"{entry_id(use)} is no longer a method"
        if "async generator" in use.kind:
            assert inspect.isasyncgenfunction(function), f"{entry_id(use)} is no longer an async generator"
        elif "coroutine" in use.kind or "replaced on instances" in use.kind:
            assert inspect.iscoroutinefunction(function), f"{entry_id(use)} is no longer a coroutine function"
        if use.params is not None:
            assert parameter_names(function) == use.params, (
                f"{entry_id(use)} now takes {parameter_names(function)}, we rely on {use.params}"
            )
    elif use.kind.startswith("instance attribute"):
        # set per instance by hivemind's code; a class-level definition would change its meaning
        found = inspect.getattr_static(owner, use.name, None)
        assert found is None, f"{entry_id(use)} is now defined on the class: {found!r}"
    for function_name, text in use.evidence:
        source = inspect.getsource(function_of(owner, function_name))
        assert text in source, f"{use.owner}.{function_name} no longer contains {text!r} ({entry_id(use)})"


def test_tensor_part_container_input_parts_are_what_the_runner_reads() -> None:
    from hivemind.averaging.partition import TensorPartContainer
    from hivemind.compression import CompressionInfo

    tensors = [torch.arange(10, dtype=torch.float32), torch.arange(7, dtype=torch.float32)]
    container = TensorPartContainer(tensors, (1.0, 2.0), part_size_bytes=12)
    by_peer = container._input_parts_by_peer
    assert isinstance(by_peer, list) and len(by_peer) == 2
    assert all(isinstance(parts, deque) for parts in by_peer)
    assert tuple(len(parts) for parts in by_peer) == container.num_parts_by_peer
    flat = [entry for parts in by_peer for entry in parts]
    assert all(isinstance(part, torch.Tensor) and isinstance(info, CompressionInfo) for part, info in flat)
    # global order (peer 0's parts, then peer 1's) is the tensors' order: what _part_numels assumes
    assert torch.equal(torch.cat([part for part, _ in flat]), torch.cat(tensors))
    container.finalize()


# --- our side: every private hivemind name our code touches is in the registry --------------


def product_files() -> list[Path]:
    files = []
    for package in PRODUCT_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                files.append(path)
    return files


def rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_self_or_super(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


REGISTERED_NAMES = {use.name for use in PRIVATE_USES}


def test_no_unregistered_private_import_from_hivemind() -> None:
    found = []
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hivemind":
                for alias in node.names:
                    if is_private(alias.name) and not any(
                        u.owner == node.module and u.name == alias.name for u in PRIVATE_USES
                    ):
                        found.append(f"{rel(path)}:{node.lineno} from {node.module} import {alias.name}")
    assert not found, "register these in engine/hivemind_private.py: " + ", ".join(found)


def test_private_accesses_on_other_objects_are_registered_or_known_not_hivemind() -> None:
    """``x._name`` where ``x`` is not ``self``/``super()`` (e.g. a hivemind object we hold)."""
    unknown, seen_allowed = [], set()
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and is_private(node.attr) and not is_self_or_super(node.value):
                key = (rel(path), ast.unparse(node))
                if key in NOT_HIVEMIND:
                    seen_allowed.add(key)
                elif node.attr not in REGISTERED_NAMES:
                    unknown.append(f"{key[0]}:{node.lineno} {key[1]}")
    assert not unknown, (
        "private members of other objects, neither in engine/hivemind_private.py nor in "
        "NOT_HIVEMIND: " + ", ".join(unknown)
    )
    assert seen_allowed == set(NOT_HIVEMIND), f"stale NOT_HIVEMIND entries: {set(NOT_HIVEMIND) - seen_allowed}"


def hivemind_names(tree: ast.Module) -> set[str]:
    """Local names bound to hivemind objects by the module's imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hivemind":
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "hivemind")
    return names


def root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def hivemind_subclasses() -> list[tuple[str, type, ast.ClassDef]]:
    """(file, class, its AST) for each top-level class of ours with a hivemind base."""
    found = []
    for path in product_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = hivemind_names(tree)
        module: ModuleType | None = None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(root_name(base) in imported for base in node.bases):
                if module is None:
                    module = importlib.import_module(rel(path)[: -len(".py")].replace("/", "."))
                found.append((rel(path), getattr(module, node.name), node))
    return found


def defined_by(cls: type) -> set[str]:
    """Names a (non-swarmtrain) class defines: its dict, annotations and ``self._x`` in its source."""
    names = set(vars(cls)) | set(getattr(cls, "__annotations__", {}))
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # builtins
        return names
    return names | set(re.findall(r"\bself\.(_\w+)", source))


def our_private_names(node: ast.ClassDef) -> tuple[set[str], set[str], dict[str, int]]:
    """(private methods/properties our class body defines, private ``self._x`` it assigns,
    private names it reads from ``self``/``super()``: name -> line)."""
    defined = {
        n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_private(n.name)
    }
    assigned: set[str] = set()
    read: dict[str, int] = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and is_private(sub.attr) and is_self_or_super(sub.value):
            if isinstance(sub.ctx, ast.Store):
                assigned.add(sub.attr)
            else:
                read.setdefault(sub.attr, sub.lineno)
    return defined, assigned, read


def test_our_hivemind_subclasses_are_found() -> None:
    names = {cls.__name__ for _, cls, _ in hivemind_subclasses()}
    assert {"ExactAllReduceRunner", "ExactAverager", "CodecCompression"} <= names, names


def ours(cls: type) -> bool:
    """A class of this project (a mixin of one of our hivemind subclasses, say)."""
    return cls.__module__.split(".")[0] in PRODUCT_PACKAGES


def unregistered_use(cls: type, name: str, why: str) -> str | None:
    """Why ``cls``'s use of a base class's private ``name`` is not covered by the registry."""
    defining = [b for b in cls.__mro__[1:] if b is not object and not ours(b) and name in defined_by(b)]
    if not defining:
        return f"{cls.__name__}: {why} {name}, which no base class defines"
    owners = {f"{base.__module__}.{base.__qualname__}" for base in defining}
    if any(use.owner in owners and use.name == name for use in PRIVATE_USES):
        return None
    return f"{cls.__name__}: {why} {name} of {sorted(owners)}, not registered"


def class_ast(cls: type) -> ast.ClassDef:
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))  # type: ignore[arg-type]
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)


def test_hivemind_subclasses_touch_only_registered_private_members() -> None:
    """In each class of ours derived from hivemind (with the mixins of ours it is made of): a
    private name it reads from ``self`` that none of our classes defines, or a private name we
    define that a hivemind base class also defines (an override, or a clash with hivemind's or
    multiprocessing's internals), must be registered for the hivemind base class that defines it."""
    problems = []
    for path, cls, node in hivemind_subclasses():
        parts = [node] + [class_ast(base) for base in cls.__mro__[1:] if ours(base)]
        defined: set[str] = set()
        assigned: set[str] = set()
        read: dict[str, int] = {}
        for part in parts:
            d, a, r = our_private_names(part)
            defined |= d
            assigned |= a
            for name, line in r.items():
                read.setdefault(name, line)
        mine = defined | assigned
        uses = [
            (name, "overrides or assigns")
            for name in sorted(mine)
            if any(name in defined_by(base) for base in cls.__mro__[1:] if base is not object and not ours(base))
        ]
        uses += [(name, f"reads (line {line})") for name, line in sorted(read.items()) if name not in mine]
        for name, why in uses:
            problem = unregistered_use(cls, name, why)
            if problem:
                problems.append(f"{path} {problem}")
    assert not problems, "\n".join(problems)


def test_registered_members_are_still_used_where_the_registry_says() -> None:
    for use in PRIVATE_USES:
        if use.kind in MIRRORED_KINDS:
            continue
        paths = re.findall(r"([\w/]+\.py)", use.used_in)
        for path in paths:
            text = (REPO_ROOT / path).read_text(encoding="utf-8")
            assert re.search(rf"\b{re.escape(use.name)}\b", text), (
                f"{entry_id(use)} is no longer used in {path}: update engine/hivemind_private.py"
            )


def test_overrides_keep_the_registered_parameters() -> None:
    """Our overrides take the parameters the registry says hivemind passes."""
    overrides = {use.name: use for use in PRIVATE_USES if use.kind.startswith("overridden")}
    seen = set()
    for _, cls, node in hivemind_subclasses():
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in overrides:
                use = overrides[item.name]
                assert issubclass(cls, resolve(use.owner)), (cls, use)
                assert parameter_names(vars(cls)[item.name]) == use.params, (cls.__name__, item.name)
                seen.add(item.name)
    assert seen == set(overrides), f"registered overrides we no longer define: {set(overrides) - seen}"


def test_methods_run_through_the_averager_pipe_are_coroutines_of_our_class() -> None:
    """``self._outer_pipe.send(("name", args, kwargs))`` runs ``name`` as a task in the averager
    process (see the ``_inner_pipe`` entry): it must be a coroutine function of the class."""
    sent = 0
    for path, cls, node in hivemind_subclasses():
        parts = [node] + [class_ast(base) for base in cls.__mro__[1:] if ours(base)]
        for call in (call for part in parts for call in ast.walk(part)):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "send"
                and isinstance(call.func.value, ast.Attribute)
                and call.func.value.attr == "_outer_pipe"
            ):
                message = call.args[0]
                assert isinstance(message, ast.Tuple) and isinstance(message.elts[0], ast.Constant), ast.unparse(call)
                name = message.elts[0].value
                assert inspect.iscoroutinefunction(getattr(cls, name, None)), f"{path}: {cls.__name__}.{name}"
                assert len(message.elts) == 3, f"{path}: {ast.unparse(call)} is not (method, args, kwargs)"
                sent += 1
    assert sent >= 2  # set_allreduce_timeout and load_verified_state


def test_rpc_overrides_are_found_as_streams_by_hivemind() -> None:
    """Our rpc_* overrides' hints are what ServicerBase understands (the ``_strip_iterator_hint``
    entry): each is a stream-output handler with the right protobuf types."""
    from hivemind.proto import averaging_pb2

    from engine.averager import ExactAverager

    class Probe(ExactAverager):  # a fresh subclass: hivemind caches handlers per class
        _rpc_handlers = None
        _stub_type = None

    Probe._collect_rpc_handlers()
    handlers = {h.method_name: h for h in Probe._rpc_handlers or ()}
    assert handlers["rpc_join_group"].request_type is averaging_pb2.JoinRequest
    assert handlers["rpc_join_group"].response_type is averaging_pb2.MessageFromLeader
    assert handlers["rpc_download_state"].response_type is averaging_pb2.DownloadData
    assert handlers["rpc_join_group"].stream_output and handlers["rpc_download_state"].stream_output
    assert not handlers["rpc_join_group"].stream_input
