"""Every private member of hivemind (a name starting with ``_``) that swarmtrain relies on.

hivemind's public API cannot do what ``engine.averager`` needs (reducers that broadcast one
encoding of each averaged part, validation of every received part, authorized matchmaking,
an adaptive all-reduce deadline, digest-checked state download), so ``ExactAllReduceRunner``
and ``ExactAverager`` override, call, read and write hivemind internals. hivemind does not
promise to keep any of them: a release may rename a method, change its parameters, stop
calling an override, or set an attribute somewhere else, and our code would then fail at run
time or, worse, silently fall back to hivemind's behaviour (e.g. averaging with non-admitted
peers, or adding deltas instead of writing bit-identical averages).

``PRIVATE_USES`` lists each of them, read from hivemind ``HIVEMIND_VERSION``, with where we
use it and why. ``tests/unit/test_hivemind_private.py`` checks every entry against the
installed hivemind (the member exists, overridden methods keep the parameters we rely on,
hivemind still calls them, attributes are still set where we expect) and scans our packages
for private hivemind names that are not listed here. When upgrading hivemind, re-read each
entry against the new source, then bump ``HIVEMIND_VERSION``.

Importing this module imports nothing from hivemind.
"""

from __future__ import annotations

from dataclasses import dataclass

HIVEMIND_VERSION = "1.1.12"
"""The hivemind release the entries below were read from."""

ALLREDUCE_RUNNER = "hivemind.averaging.allreduce.AllReduceRunner"
TENSOR_PART_CONTAINER = "hivemind.averaging.partition.TensorPartContainer"
AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
MATCHMAKING = "hivemind.averaging.matchmaking.Matchmaking"
POTENTIAL_LEADERS = "hivemind.averaging.matchmaking.PotentialLeaders"
SERVICER_BASE = "hivemind.p2p.servicer.ServicerBase"
P2P_DAEMON = "hivemind.p2p.p2p_daemon.P2P"
STEP_CONTROL = "hivemind.averaging.control.StepControl"

AVERAGING = "engine/averager.py"
ALLREDUCE = "engine/allreduce.py"
GATE = "engine/averager_gate.py"
STATE = "engine/state_transfer.py"
BAD_TENSORS = "tests/integration/test_bad_tensors.py"
PUNCHER = "peer/net/puncher.py"


@dataclass(frozen=True)
class PrivateUse:
    """One private hivemind member we use."""

    owner: str
    """Dotted path of the hivemind class (or module) that defines it."""
    name: str
    """The member's name on ``owner``."""
    kind: str
    """What it is and how we use it: ``overridden ... method`` (our subclass replaces it and
    hivemind calls ours), ``called ... method``, ``method replaced on instances``, ``instance
    attribute (read|written|...)`` (set in hivemind's code, not visible on the class),
    or a behaviour of that member we depend on without naming it (``... convention``,
    ``... format``, ``... protocol``)."""
    used_in: str
    """Where: ``path (qualified name)``, several separated by ``; ``."""
    why: str
    """What we need it for."""
    params: tuple[str, ...] | None = None
    """Methods: the parameter names (without ``self``) our override or call relies on."""
    evidence: tuple[tuple[str, str], ...] = ()
    """(function of ``owner``, text its source must contain): where hivemind sets the
    attribute or calls the method, so that a change there fails the test."""


MIRRORED_KINDS = frozenset(
    {
        "pipe dispatch protocol",
        "DHT key convention",
        "stream format",
        "handler naming convention",
        "type hint convention",
    }
)
"""Kinds of entries that describe behaviour we depend on without naming the member in our code."""


PRIVATE_USES: tuple[PrivateUse, ...] = (
    # --- hivemind.averaging.allreduce.AllReduceRunner: ExactAllReduceRunner's base ---------
    PrivateUse(
        ALLREDUCE_RUNNER,
        "_communicate_with_peer",
        "overridden coroutine method",
        f"{ALLREDUCE} (ExactAllReduceRunner._communicate_with_peer)",
        "Our own parts go through the codec like everyone else's, and parts averaged by another "
        "reducer are decoded and written in place of ours (bit-identical), not added as deltas.",
        params=("peer_id",),
        evidence=(("run", "self._communicate_with_peer(peer_id)"),),
    ),
    PrivateUse(
        ALLREDUCE_RUNNER,
        "_generate_input_for_peer",
        "overridden async generator method",
        f"{ALLREDUCE} (ExactAllReduceRunner._generate_input_for_peer, _receive_from_reducer); "
        f"{BAD_TENSORS} (LyingRunner._generate_input_for_peer)",
        "Reuses hivemind's framing of the parts we send a reducer (first message carries the "
        "group id and PART_FOR_AVERAGING) through super(), counting bytes sent; the bad-tensor "
        "test rewrites the weight in it.",
        params=("peer_index",),
        evidence=(("_communicate_with_peer", "self._generate_input_for_peer(peer_index)"),),
    ),
    PrivateUse(
        ALLREDUCE_RUNNER,
        "_accumulate_parts_streaming",
        "overridden async generator method",
        f"{ALLREDUCE} (ExactAllReduceRunner._accumulate_parts_streaming)",
        "Reducer side: validates each received part (size, finiteness, weight) before it is "
        "accumulated, gives stale members weight 0, and sends every sender the same encoding "
        "of the averaged part instead of per-sender deltas.",
        params=("stream", "sender_index"),
        evidence=(("rpc_aggregate_part", "self._accumulate_parts_streaming("),),
    ),
    PrivateUse(
        ALLREDUCE_RUNNER,
        "_get_peer_stub",
        "called method",
        f"{ALLREDUCE} (ExactAllReduceRunner._open_parts_stream)",
        "The stub for the reducer's rpc_aggregate_part under the averager's namespace (where the "
        "bulk channel has no direct path, engine.bulk_channel).",
        params=("peer",),
    ),
    PrivateUse(
        ALLREDUCE_RUNNER,
        "_ban_sender",
        "called coroutine method",
        f"{ALLREDUCE} (ExactAllReduceRunner._accumulate_parts_streaming)",
        "Excludes a sender whose stream ended early or was refused, as hivemind's own "
        "_accumulate_parts_streaming does, so the reducer does not wait for its parts.",
        params=("peer_id",),
    ),
    # --- hivemind.averaging.partition.TensorPartContainer ---------------------------------
    PrivateUse(
        TENSOR_PART_CONTAINER,
        "_input_parts_by_peer",
        "instance attribute (read)",
        f"{ALLREDUCE} (ExactAllReduceRunner.__init__; InPlaceOutputs.__init__, register_failed_reducer)",
        "A list (one deque per peer) of (part, CompressionInfo): the size of every part in "
        "global order, so that each received part is checked for its exact size before decoding, "
        "and where each part starts in the vector (InPlaceOutputs writes averaged parts there).",
        evidence=(
            ("__init__", "self._input_parts_by_peer = ["),
            ("__init__", "self._input_parts_by_peer[current_peer_index].append((part, part_info))"),
        ),
    ),
    PrivateUse(
        TENSOR_PART_CONTAINER,
        "_outputs_registered_by_peer",
        "instance attribute (read and written)",
        f"{ALLREDUCE} (InPlaceOutputs.register_processed_part, register_failed_reducer)",
        "How many averaged parts of each reducer arrived: the next expected part index, as "
        "hivemind's register_processed_part keeps it; InPlaceOutputs advances it itself.",
        evidence=(
            ("__init__", "self._outputs_registered_by_peer = [0 for _ in range(self.group_size)]"),
            ("register_processed_part", "self._outputs_registered_by_peer[peer_index] += 1"),
        ),
    ),
    PrivateUse(
        TENSOR_PART_CONTAINER,
        "_outputs_consumed",
        "instance attribute (read and written)",
        f"{ALLREDUCE} (InPlaceOutputs.iterate_output_tensors)",
        "Marks the outputs as iterated, as hivemind's iterate_output_tensors does (finalize sets it too).",
        evidence=(
            ("iterate_output_tensors", "self._outputs_consumed = True"),
            ("finalize", "self._outputs_consumed = True"),
        ),
    ),
    # --- hivemind.averaging.averager.DecentralizedAverager: ExactAverager's base ----------
    PrivateUse(
        AVERAGER,
        "_run_allreduce_inplace_",
        "overridden coroutine method",
        f"{AVERAGING} (ExactAverager._run_allreduce_inplace_, which runs engine/fragment_rounds.py)",
        "Builds our ExactAllReduceRunners (codec, stale members; one per fragment of the vector, "
        "run at once) instead of AllReduceRunner, records round stats.",
        params=("tensors", "group_info", "group_id", "kwargs"),
        evidence=(
            (
                "_aggregate_with_group",
                "self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=peer_fractions, **kwargs)",
            ),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_register_allreduce_group",
        "overridden context-manager method",
        f"{AVERAGING} (ExactAverager._register_allreduce_group)",
        "Registers every fragment's group id (engine.fragments) along with the group, before "
        "hivemind's registration wakes rpc_aggregate_part calls that arrived early.",
        params=("group_info",),
        evidence=(
            ("_step", "with self._register_allreduce_group(group_info):"),
            ("_register_allreduce_group", "self._pending_groups_registered.set()"),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_shutdown",
        "overridden coroutine method",
        f"{AVERAGING} (ExactAverager._shutdown)",
        "Before hivemind removes the handlers and the process exits, lets this reducer's senders "
        "take their last averaged parts (a round no longer waits for that: engine.serving).",
        params=("timeout",),
        evidence=(
            ("shutdown", 'self._outer_pipe.send(("_shutdown", [self.shutdown_timeout], {}))'),
            ("_shutdown", "await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)"),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_aggregate_with_group",
        "overridden coroutine method",
        f"{AVERAGING} (ExactAverager._aggregate_with_group)",
        "Refuses a group with a member the coordinator did not admit, and returns gathered data "
        "plus the round's stats to step()'s caller; super() does load balancing and unpacks the gather.",
        params=("group_info", "min_vector_size", "kwargs"),
        evidence=(("_step", "self._aggregate_with_group("), ("__init__", "min_vector_size=min_vector_size")),
    ),
    PrivateUse(
        AVERAGER,
        "_running_groups",
        "instance attribute (read and written)",
        f"{AVERAGING} (ExactAverager._register_allreduce_group), engine/fragment_rounds.py (FragmentRoundsMixin._fragment_runner)",
        "Registers each fragment's runner under its group id (a future set to the runner) so that "
        "incoming rpc_aggregate_part calls reach it, as hivemind's own _run_allreduce_inplace_ does.",
        evidence=(
            ("__init__", "self._running_groups: Dict[GroupID, asyncio.Future[AllReduceRunner]] = {}"),
            ("rpc_aggregate_part", "future = self._running_groups.get(request.group_id)"),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_p2p",
        "instance attribute (read)",
        f"engine/fragment_rounds.py (FragmentRoundsMixin._fragment_runner), {STATE} (_download_state_from), "
        "engine/bulk_channel.py (BulkChannelMixin._bulk_ticket, _direct_hosts)",
        "The averager process's P2P: given to our runner, used for the rpc_download_state and "
        "rpc_bulk_ticket stubs and to read the address of a reducer's libp2p connection.",
        evidence=(("_run_internal", "self._p2p = await self.dht.replicate_p2p()"),),
    ),
    PrivateUse(
        AVERAGER,
        "_matchmaking",
        "instance attribute overridden by a property",
        f"{GATE} (AdmissionGateMixin._matchmaking), {STATE} (_load_verified_state)",
        "hivemind assigns its Matchmaking to self._matchmaking in the averager process; our "
        "property's setter wraps its _request_join_group so that we never ask a non-admitted "
        "leader; group_key_manager.prefix names the state-download key.",
        evidence=(
            ("_run_internal", "self._matchmaking = Matchmaking("),
            ("rpc_join_group", "self._matchmaking.rpc_join_group(request, context)"),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_outer_pipe",
        "instance attribute (read)",
        f"{AVERAGING} (ExactAverager.set_allreduce_timeout), {STATE} (load_verified_state)",
        "The host process's end of the control pipe to the averager process: we send "
        "(method name, args, kwargs) to run our coroutines there.",
        evidence=(("__init__", "self._inner_pipe, self._outer_pipe = mp.Pipe(duplex=True)"),),
    ),
    PrivateUse(
        AVERAGER,
        "_inner_pipe",
        "pipe dispatch protocol",
        f"{AVERAGING} (ExactAverager.set_allreduce_timeout -> _set_allreduce_timeout, "
        "abandon_search -> _abandon_search, load_verified_state -> _load_verified_state)",
        "The averager process reads (method, args, kwargs) and runs getattr(self, method)(...) as "
        "a task: the named method must be a coroutine function of our class.",
        evidence=(
            ("_run_internal", "method, args, kwargs = self._inner_pipe.recv()"),
            ("_run_internal", "asyncio.create_task(getattr(self, method)(*args, **kwargs))"),
        ),
    ),
    PrivateUse(
        STEP_CONTROL,
        "_allow_retries",
        "instance attribute (written)",
        "engine/matchmaking.py (RoundMatchmaking.give_up_search)",
        "A search given up from inside ends as 'could not find a group'; hivemind's _step would "
        "then look again until the step's deadline unless the step allows no retries.",
        evidence=(
            ("__init__", "self._allow_retries = data_for_gather, deadline, allow_retries"),
            ("__setstate__", 'self._allow_retries = state["immutable_params"]'),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_allreduce_timeout",
        "instance attribute (written)",
        f"{AVERAGING} (ExactAverager._set_allreduce_timeout)",
        "The all-reduce deadline of each step; written to adapt it to measured all-reduce times.",
        evidence=(
            ("__init__", "self._allreduce_timeout = averaging_alpha, allreduce_timeout"),
            ("_step", "timeout=self._allreduce_timeout"),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_declare_for_download_periodically",
        "DHT key convention",
        f"{STATE} (StateTransferMixin._load_verified_state)",
        "Averagers that serve their state declare themselves under "
        "'{group_key_manager.prefix}.all_averagers' (subkey: peer id bytes); we list servers there.",
        evidence=(
            (
                "_declare_for_download_periodically",
                'download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"',
            ),
            ("_declare_for_download_periodically", "subkey=self.peer_id.to_bytes()"),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_get_current_state_from_host_process",
        "called coroutine method",
        f"{STATE} (StateTransferMixin._serve_state)",
        "Asks the host process for the served state (our get_current_state: its round, digest "
        "and file, engine.state_snapshot) through hivemind's background thread there, as "
        "hivemind's rpc_download_state does; the averager then streams the file itself.",
        params=(),
        evidence=(
            ("_get_current_state_from_host_process", 'self._inner_pipe.send(("_TRIGGER_GET_CURRENT_STATE", future))'),
            ("__init__", "target=_background_thread_fetch_current_state"),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_load_state_from_peers",
        "stream format",
        f"{STATE} (StateTransferMixin._download_state_from)",
        "Our digest-checked download parses rpc_download_state's stream as hivemind does, and "
        "our server (StateTransferMixin._serve_state) writes it so: metadata on the first "
        "message, a tensor part with a dtype starts the next tensor.",
        evidence=(
            ("_load_state_from_peers", "if message.tensor_part.dtype and current_tensor_parts:"),
            ("rpc_download_state", "yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)"),
        ),
    ),
    PrivateUse(
        AVERAGER,
        "_step",
        "overridden coroutine method",
        f"{AVERAGING} (ExactAverager._step)",
        "Runs one step in the averager process: our override sets the matchmaking's group_bits "
        "to the round the step gathers (each round meets under its own DHT key, "
        "engine.matchmaking.round_group_bits) before hivemind looks for the group. The public "
        "Matchmaking members engine.matchmaking.RoundMatchmaking reads and re-defines "
        "(target_group_size, min_group_size, current_followers, step_control.data_for_gather, "
        "potential_leaders' leader_queue, max_assured_time and declared_expiration_time) are "
        "read in that step.",
        params=("step", "future_for_init"),
        evidence=(
            ("step", '("_step", [], dict(step=step, future_for_init=future_for_init))'),
            ("_step", "await self._matchmaking.look_for_group(step)"),
        ),
    ),
    # --- hivemind.averaging.matchmaking.PotentialLeaders ---------------------------------
    PrivateUse(
        POTENTIAL_LEADERS,
        "_update_queue_periodically",
        "overridden coroutine method",
        "engine/matchmaking.py (RoundPotentialLeaders._update_queue_periodically)",
        "The search's task that fills leader_queue from the round's declarations: ours looks "
        "again for as long as the search runs and is not paused (hivemind's stops once the "
        "earliest known peer expires after the search ends, and misses a late peer that "
        "declares an earlier expiration). It keeps hivemind's contract with pop_next_leader "
        "(update_finished after each lookup; past_attempts skipped; max_assured_time raised, "
        "which RoundMatchmaking._first_in_line reads).",
        params=("key_manager",),
        evidence=(
            ("begin_search", "asyncio.create_task(self._update_queue_periodically(key_manager))"),
            ("pop_next_leader", "if self.update_finished.is_set():"),
        ),
    ),
    # --- hivemind.averaging.matchmaking.Matchmaking ---------------------------------------
    PrivateUse(
        MATCHMAKING,
        "_request_join_group",
        "method replaced on instances",
        f"{GATE} (AdmissionGateMixin._matchmaking setter)",
        "Replaced on the averager's Matchmaking by a wrapper that skips leaders the coordinator "
        "did not admit (joining one would fail the round). hivemind must keep calling it through "
        "self, for each potential leader and for a leader's suggested leader.",
        params=("leader",),
        evidence=(
            ("_request_join_potential_leaders", "group = await self._request_join_group(next_leader)"),
            ("_request_join_group", "return await self._request_join_group(suggested_leader)"),
        ),
    ),
    PrivateUse(
        MATCHMAKING,
        "_check_reasons_to_reject",
        "overridden method",
        "engine/matchmaking.py (RoundMatchmaking._check_reasons_to_reject)",
        "Called by a leader's rpc_join_group once it holds lock_request_join_group: our override "
        "adds a reason, a request that waited there past half of request_timeout (its sender has "
        "given up on it, yet hivemind would count it in the group). request_timeout is read.",
        params=("request", "context"),
        evidence=(
            ("rpc_join_group", "reason_to_reject = self._check_reasons_to_reject(request, context)"),
            ("_request_join_group", "message = await asyncio.wait_for(anext(stream), timeout=self.request_timeout)"),
        ),
    ),
    *(
        PrivateUse(
            MATCHMAKING,
            name,
            "instance attribute (read)",
            "engine/matchmaking.py (RoundMatchmaking._ask_alive); engine/group_start.py (GroupStartMixin._fetch_start)",
            "The averager's P2P, servicer class and namespace, from which hivemind's own matchmaking "
            "builds a stub to call a leader: ours builds one the same way to probe a roster member "
            "that has not joined (engine.liveness) and to fetch a group's start from a member that "
            "holds it (engine.start_tree).",
            evidence=(
                ("__init__", f"self.{name} = {name.lstrip('_')}"),
                ("_request_join_group", "self._servicer_type.get_stub(self._p2p, leader, namespace=self._prefix)"),
            ),
        )
        for name in ("_p2p", "_servicer_type", "_prefix")
    ),
    # --- hivemind.p2p.servicer.ServicerBase: how RPC handlers are found and named -----------
    PrivateUse(
        SERVICER_BASE,
        "_get_handle_name",
        "handler naming convention",
        f"{AVERAGING} (ExactAverager, runner servicer_type=type(self)); "
        f"{BAD_TENSORS} (weight_liar names its class 'ExactAverager')",
        "RPC handles are '{namespace}::{class name}.{method}': every averager of a run (peers and "
        "the coordinator's archiver) must be a class named ExactAverager to reach the others.",
        evidence=(("_get_handle_name", 'handle_name = f"{cls.__name__}.{method_name}"'),),
    ),
    PrivateUse(
        SERVICER_BASE,
        "_strip_iterator_hint",
        "type hint convention",
        f"{GATE} (AdmissionGateMixin.rpc_join_group, rpc_download_state)",
        "Our rpc_* overrides annotate their return as typing.AsyncIterator (not collections.abc): "
        "hivemind reads the hints with get_type_hints and recognizes a stream only by "
        "the typing alias's _name.",
        evidence=(
            ("_strip_iterator_hint", 'hint._name in ("AsyncIterator", "AsyncIterable")'),
            ("_collect_rpc_handlers", "hints = get_type_hints(method)"),
        ),
    ),
    # --- hivemind.p2p.p2p_daemon.P2P: the daemon's control client ---------------------------
    PrivateUse(
        P2P_DAEMON,
        "_client",
        "instance attribute (read)",
        f"{PUNCHER} (Puncher._switch); engine/dial_order.py (open_round_connections)",
        "The daemon's control client: its disconnect and connect move this peer's connection to a "
        "relayed peer onto a hole-punched socket, and its connect makes a round's connections "
        "before the parts flow, one end of each pair dialling (P2P has no public connect or disconnect).",
        evidence=(("replicate", "self._client = await p2pclient.Client.create("),),
    ),
)
