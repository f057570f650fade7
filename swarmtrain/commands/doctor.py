"""``swarmtrain doctor``: is this machine useful for a run, and what to do where it is not.

One verdict line per check (``ok``, ``warn``, ``FAIL`` with its fix, ``skip`` with why), or
``--json``; exit status 1 when any check failed. With ``--coordinator`` the run's coordinator
answers a probe (``coordinator.probe``): versions, spec digest, clock skew, its DHT bootstrap
peers, a dial-back to ``--port`` and the bandwidth; the run's spec (or ``--spec``) gives the
model whose memory and speed are checked (``swarmtrain.doctor``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from peer.net.announce import Announced, announced, coordinator_address, parse_host_port
from peer.net.dial_back import Greeter
from peer.node.footprint import Footprint, estimate
from protocol.errors import ConfigError, SpecError
from protocol.identity import default_key_path
from protocol.modelsize import task_params
from protocol.spec import RunSpec, load_spec, local_compute, parse_spec
from swarmtrain.doctor import machine, remote
from swarmtrain.doctor.verdict import Verdict, run_check, skipped

DEFAULT_PORT = 0
"""As `swarmtrain peer --port`: any free port the system picks."""
"""The port the doctor asks the coordinator to dial back (the peer image's port)."""


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check this machine for a run: libraries, GPU, memory, network, expected contribution",
        description="Check that this machine can run a swarmtrain peer, and how much it would contribute. "
        "One line per check; each failure says what to do. Exit status 1 if any check failed.",
    )
    parser.add_argument(
        "--coordinator",
        type=coordinator_address,
        metavar="HOST:PORT",
        help="the run's coordinator (checks the network too)",
    )
    parser.add_argument("--spec", type=Path, default=None, help="a run spec (default: the coordinator's)")
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="TCP port the peer will listen on, for the dial-back check (default: 0, any free port, as "
        "`swarmtrain peer --port`; give the peer's --port where a mapping or firewall opens one)",
    )
    parser.add_argument(
        "--announce",
        metavar="HOST:PORT",
        default=None,
        help="the public address the peer will announce (its mapping forwards to --port): dialled back to check it",
    )
    parser.add_argument("--key", type=Path, default=None, help=f"identity key file (default: {default_key_path()})")
    parser.add_argument("--skip-network", action="store_true", help="no loopback DHT (without --coordinator)")
    parser.add_argument("--no-benchmark", action="store_true", help="do not time the run's inner steps here")
    parser.add_argument(
        "--micro-batches", type=int, default=None, metavar="N", help="check the peer flag of that name (causal_lm runs)"
    )
    parser.add_argument(
        "--activation-checkpointing", choices=("on", "off"), default=None, help="check the peer flag of that name"
    )
    parser.add_argument("--compile", choices=("on", "off"), default=None, help="check the peer flag of that name")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="token runs: where the peer will keep the run's data (as `swarmtrain peer --data-dir`)",
    )
    parser.add_argument(
        "--requirements",
        action="store_true",
        help="print what one peer of the run needs (GPU memory, host RAM, disk, GB per day up and down) and exit",
    )
    parser.add_argument(
        "--round-s",
        type=float,
        default=None,
        metavar="S",
        help="with --requirements: seconds per round for the per-day figures (default: the spec's time budget)",
    )
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.announce is not None:
        parse_host_port(args.announce)  # a ConfigError naming what is wrong, before any check
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"swarmtrain doctor: error: --port must be 0-65535, got {args.port}")
    if args.requirements:
        return _requirements(args)
    verdicts: list[Verdict] = []

    def add(verdict: Verdict) -> Verdict:
        verdicts.append(verdict)
        if not args.json:
            print(verdict.line(), flush=True)
        return verdict

    add(run_check("python", machine.python))
    add(run_check("packages", machine.packages))
    add(run_check("protocol stubs", machine.stubs))
    acc = machine.Accelerator(0, [], [], False, None)

    def accelerator() -> tuple[str, dict[str, Any]]:
        nonlocal acc
        acc = machine.accelerator()
        return machine.describe_accelerator(acc)

    add(run_check("accelerator", accelerator))
    add(run_check("identity", lambda: machine.identity(args.key or default_key_path())))
    add(run_check("open files", machine.open_files))

    spec, source = _local_spec(args, add)
    rates: dict[str, float] = {}
    if args.coordinator:
        spec, source, rates = _remote_checks(args, spec, source, add)
    elif not args.skip_network:
        add(run_check("loopback DHT", machine.loopback_dht))
    _model_checks(args, spec, source, acc, rates, add)

    failed = [v for v in verdicts if v.status == "fail"]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [v.as_dict() for v in verdicts]}, indent=2))
    else:
        warned = sum(v.status == "warn" for v in verdicts)
        summary = f"{len(failed)} check(s) failed" if failed else "all checks passed"
        print(summary + (f", {warned} warning(s)" if warned else ""))
    return 1 if failed else 0


def _requirements(args: argparse.Namespace) -> int:
    """``--requirements``: the spec's (``--spec``, else the coordinator's) needs of one peer."""
    from swarmtrain.doctor.requirements import requirements

    if args.spec is not None:
        spec, source = load_spec(args.spec), str(args.spec)
    elif args.coordinator:
        link = remote.connect(args.coordinator)
        try:
            spec = parse_spec(link.info.spec_toml, source="the coordinator's spec")
        finally:
            link.close()
        source = f"the run's spec ({args.coordinator})"
    else:
        raise ConfigError("--requirements needs the run's spec: --spec FILE or --coordinator HOST:PORT")
    try:
        needs = requirements(spec, round_s=args.round_s)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if args.json:
        print(json.dumps({"spec": source, "run": spec.run.name, **needs.as_dict()}, indent=2))
        return 0
    print(f"one peer of {spec.run.name} ({source}) needs:")
    for line in needs.lines():
        print(f"  {line}")
    return 0


def _local_spec(args: argparse.Namespace, add: Any) -> tuple[RunSpec | None, str]:
    if args.spec is None:
        return None, ""
    try:
        spec = load_spec(args.spec)
    except SpecError as exc:
        add(
            Verdict("spec", "fail", f"{args.spec}: {'; '.join(exc.problems)}", "fix the spec (`swarmtrain spec check`)")
        )
        return None, ""
    except OSError as exc:
        add(Verdict("spec", "fail", f"{args.spec}: {exc.strerror}", "check the path"))
        return None, ""
    add(Verdict("spec", "ok", f"{args.spec} is valid ({spec.digest()})"))
    return spec, str(args.spec)


def _remote_checks(
    args: argparse.Namespace, spec: RunSpec | None, source: str, add: Any
) -> tuple[RunSpec | None, str, dict[str, float]]:
    """The checks against the coordinator; the spec to check the model against, its source, and
    the measured link (``upload_bits_per_s``, ``download_bits_per_s``; empty if not measured)."""
    link: remote.Link | None = None

    def connect() -> tuple[str, dict[str, Any]]:
        nonlocal link
        link = remote.connect(args.coordinator)
        return remote.reachable(link)

    add(run_check("coordinator", connect))
    dependent = ("version", "spec digest", "clock", "DHT bootstrap", "reachable from outside", "bandwidth")
    if link is None:
        for name in dependent:
            add(skipped(name, "the coordinator did not answer"))
        return spec, source, {}
    try:
        add(run_check("version", lambda: remote.versions(link)))
        run_spec = _run_spec(link, add)
        if spec is not None:
            local_digest = spec.digest()
            add(run_check("spec digest", lambda: remote.spec_digest(link, local_digest, source)))
        else:
            add(skipped("spec digest", "no --spec given: a peer uses the run's spec"))
        if run_spec is not None:
            spec, source = run_spec, f"the run's spec ({args.coordinator})"
        add(run_check("clock", lambda: remote.clock(link)))
        add(run_check("DHT bootstrap", lambda: remote.bootstrap(link)))
        add(_dial_back(link, args.port, announced(args.announce, port=args.port, env=os.environ)))
        bandwidth = add(run_check("bandwidth", lambda: remote.bandwidth(link)))
        return spec, source, {k: float(v) for k, v in bandwidth.data.items() if k.endswith("_bits_per_s") and v}
    finally:
        link.close()


def _run_spec(link: remote.Link, add: Any) -> RunSpec | None:
    try:
        return parse_spec(link.info.spec_toml, source="the coordinator's spec")
    except SpecError as exc:
        add(
            Verdict("run spec", "fail", "; ".join(exc.problems), "ask the run's operator: its spec does not parse here")
        )
        return None


def _dial_back(link: remote.Link, port: int, announce: Announced | None) -> Verdict:
    try:
        greeter = Greeter(port)
    except OSError as exc:
        return Verdict(
            "reachable from outside",
            "warn",
            f"cannot listen on TCP port {port} ({exc.strerror}): is a peer already running there?",
            "run the doctor with --port set to a free port you can open",
        )
    try:
        return run_check("reachable from outside", lambda: remote.dial_back(link, greeter, announce))
    finally:
        greeter.close()


def _model_checks(
    args: argparse.Namespace,
    spec: RunSpec | None,
    source: str,
    acc: machine.Accelerator,
    rates: dict[str, float],
    add: Any,
) -> None:
    upload, download = rates.get("upload_bits_per_s"), rates.get("download_bits_per_s")
    if spec is None:
        for name in ("memory", "/dev/shm", "expected contribution"):
            add(skipped(name, "no run spec: pass --coordinator HOST:PORT or --spec FILE"))
        return
    if task_params(spec) is None:
        for name in ("memory", "/dev/shm", "expected contribution"):
            add(skipped(name, "the run's imported task declares no parameter count (task.params)"))
        return
    if args.micro_batches is not None or args.activation_checkpointing is not None or args.compile is not None:
        checkpointing = None if args.activation_checkpointing is None else args.activation_checkpointing == "on"
        compile_blocks = None if args.compile is None else args.compile == "on"
        try:  # as the peer would compute with these flags (the run's spec and digest are unchanged)
            spec = local_compute(
                spec, micro_batches=args.micro_batches, checkpointing=checkpointing, compile_blocks=compile_blocks
            )
        except ConfigError as exc:
            add(Verdict("memory", "fail", str(exc), "use flags the run can take (or none: the run's own)"))
            for name in ("/dev/shm", "expected contribution"):
                add(skipped(name, "the peer flags do not fit the run"))
            return
        own = [f"--micro-batches {args.micro_batches}"] if args.micro_batches is not None else []
        own += [f"--activation-checkpointing {args.activation_checkpointing}"] if args.activation_checkpointing else []
        own += [f"--compile {args.compile}"] if args.compile else []
        source += f", with {' '.join(own)}"
    fit: machine.Fit | None = None

    def memory() -> tuple[str, dict[str, Any]]:
        nonlocal fit
        fit, detail, data = machine.memory(spec, acc)
        return f"{detail}; {source}", data

    add(run_check("memory", memory))
    if spec.data.source == "tokens":
        from swarmtrain.doctor.data import data_check

        add(run_check("data", lambda: data_check(spec, args.data_dir)))
    footprint = fit.footprint if fit is not None else _footprint_or_none(spec, acc)
    if footprint is not None and upload:
        from swarmtrain.doctor.round_cost import round_cost

        add(run_check("averaging on this uplink", lambda: round_cost(spec.averaging, footprint.params, upload)))
    if footprint is not None and download:
        from swarmtrain.doctor.round_cost import join_cost

        add(run_check("joining on this downlink", lambda: join_cost(spec.averaging, footprint.params, download)))
    add(run_check("/dev/shm", lambda: machine.shm(footprint)))
    if fit is None:
        add(skipped("expected contribution", "the model does not fit this machine"))
    elif args.no_benchmark:
        add(skipped("expected contribution", "--no-benchmark"))
    else:
        from swarmtrain.doctor.contribution import expected

        device = "cuda" if acc.count else "cpu"
        params = fit.footprint.params
        gpus = acc.count if acc.count and not fit.sharded else 1
        add(
            run_check(
                "expected contribution",
                lambda: expected(spec, device=device, params=params, upload_bits_per_s=upload, gpus=gpus),
            )
        )


def _footprint_or_none(spec: RunSpec, acc: machine.Accelerator) -> Footprint | None:
    try:
        return estimate(spec, accelerator=acc.count > 0, local_ranks=max(1, acc.count))
    except ValueError:  # a task whose size the spec does not give: the memory check said so
        return None
