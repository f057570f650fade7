"""How much memory a peer needs for a run, from the spec alone (``swarmtrain doctor``).

The per-parameter costs are the buffers a peer really holds (``peer.round.trainer``'s module
docstring; ``tests/unit/test_footprint.py`` measures them on a real trainer and checks this
estimate against what it allocated):

- on the training device, per local rank: the fp32 parameters, their gradients and the inner
  optimizer's state (AdamW: two moments; SGD: none); sharded over the node's ranks with FSDP2
  these are divided by the ranks, plus one layer gathered whole;
- in host memory, in the leader's process: the global parameters θ_g and the outer momentum,
  the codec residual (lossy codecs with error feedback) and, with overlap, the launch point (one
  fragment's when the fragments are averaged in turn, ``averaging.sync_fragments``);
  with FSDP the leader also keeps a full copy of the model in host memory;
- in shared memory (``/dev/shm``): the averager's vector, one fp32 value per parameter (per
  parameter of the longest fragment when they are averaged in turn), which
  hivemind's averaging process shares with the trainer; training on the CPU without overlap on
  one rank, the gradients live in it (``peer.round.grad_home``) and take no memory of their own;
- serving the state to a newcomer takes no memory: θ_g and the momentum are written to a file
  once per round a newcomer asks, and streamed from it (``engine.state_snapshot``; on disk,
  ``swarmtrain.doctor.requirements``).

Activations are estimated for one micro-batch, counted from what a transformers decoder layer
keeps for its backward with fp32 master weights under bf16/fp16 autocast: the residual stream
and the RMSNorm/LayerNorm inputs and outputs in fp32 (~24 bytes per token per hidden unit),
the projections' inputs, q/k/v, rotary and attention outputs in 16 bits (~17 bytes), and the
MLP's gate, up, activation and product in 16 bits (8 bytes per token per intermediate unit):
``41·hidden + 8·intermediate`` bytes per token per layer (fp32 on CPU: ``58·hidden +
16·intermediate``). With activation checkpointing each layer keeps its fp32 input (4·hidden)
and one layer is recomputed whole. Plus the loss: a causal LM's loss head
(``peer.task.lm_head``) holds one chunk of at most ``loss_chunk_rows`` tokens' logits (16-bit,
fp32 log-probabilities and the 16-bit gradient: 8 bytes per token per vocabulary entry; 12 on
CPU), the head's fp32 weight gradient and its 16-bit copy (6 bytes per head parameter; 4 on
CPU); the byte-level GPT keeps the micro-batch's logits (fp32 from the loss, their 16-bit
original and the gradient: 10 bytes per token per vocabulary entry; 12 on CPU). And
autocast's 16-bit copies of the weights (2 bytes per parameter). Checked against an H200's
allocator peaks for ``examples/llama-1b.toml`` at four micro-batch/checkpointing settings
(25 to 52 GiB, eager; compiled blocks need less) (``tests/unit/test_footprint.py``). Fixed costs: the CUDA
context and libraries on the device, the interpreter, torch, hivemind and p2pd in host memory.
These are estimates; the doctor says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.fragments import fragment_bounds
from protocol.modelsize import VOCAB_SIZE, loss_chunk_rows, task_params

if TYPE_CHECKING:
    from protocol.spec import RunSpec

GIB = 1 << 30
DEVICE_BASE_BYTES = 1 * GIB
"""CUDA context, cuBLAS/cuDNN workspaces and allocator slack on each GPU."""
HOST_BASE_BYTES = GIB + GIB // 2
"""Interpreter, torch, hivemind's averaging process and p2pd (measured ~1.1 GiB RSS in all)."""
FP32 = 4
RESIDUAL_BYTES = 2
"""Bytes per value of the codec residual (``engine.compression.RESIDUAL_DTYPE``, bfloat16;
torch-free here, checked by a test)."""
LOSSY_CODECS = ("fp16", "int8", "4bit", "sparse")
"""Codecs whose residual a peer carries (``engine.compression``; torch-free here, checked by a test)."""

Where = Literal["device", "host", "shm"]


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    where: Where


@dataclass(frozen=True)
class Footprint:
    """A peer's memory needs: per accelerator (``device``), host RAM and ``/dev/shm``."""

    params: int
    items: list[Item] = field(default_factory=list)
    accelerator: bool = False

    def total(self, where: Where) -> int:
        """Bytes needed in ``where``; on a CPU peer the device's share is host memory."""
        if where == "host" and not self.accelerator:
            return sum(i.bytes for i in self.items if i.where in ("host", "device"))
        if where == "device" and not self.accelerator:
            return 0
        return sum(i.bytes for i in self.items if i.where == where)

    def describe(self, where: Where) -> str:
        """The largest items of ``where``, e.g. "parameters 4.6 GiB, AdamW moments 9.2 GiB"."""
        wanted: tuple[str, ...] = ("host", "device") if where == "host" and not self.accelerator else (where,)
        items = sorted((i for i in self.items if i.where in wanted), key=lambda i: -i.bytes)
        return ", ".join(f"{i.name} {gib(i.bytes)}" for i in items[:4])


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.0f} MiB"


def estimate(spec: RunSpec, *, accelerator: bool, local_ranks: int = 1, sharded: bool = False) -> Footprint:
    """The memory a peer of ``spec`` needs. ``accelerator``: training on GPUs (else CPU);
    ``local_ranks``: GPUs of the node; ``sharded``: FSDP2 over them (else each holds a replica).
    Raises ``ValueError`` for a task whose size the spec does not give."""
    n = task_params(spec)
    if n is None:
        raise ValueError("the spec's task declares no parameter count: its memory cannot be estimated")
    ranks = max(1, local_ranks)
    per_param = 4 * FP32 if spec.inner.optimizer == "adamw" else 2 * FP32  # params, grads (+ 2 moments)
    share = ranks if sharded else 1
    # averaged in turn, the averager's vector and the launch point are one fragment long
    fragment = max(end - start for start, end in fragment_bounds(n, spec.averaging.fragments_in_turn))
    in_turn = fragment < n
    in_vector = (
        not accelerator and not spec.averaging.overlap and not in_turn and ranks == 1
    )  # ``peer.round.grad_home``
    items = [
        Item("parameters", n * FP32 // share, "device"),
        Item("gradients", n * FP32 // share, "shm" if in_vector else "device"),
    ]
    if per_param > 2 * FP32:
        items.append(Item("AdamW moments", 2 * n * FP32 // share, "device"))
    # one micro-batch: the gradients (set to None between steps) are made as the backward frees
    # the activations, so the step needs the larger of the two, not their sum
    overlapping = n * FP32 // share if _micro_batches(spec) == 1 and not in_vector else 0
    sharded_layer = (n // max(1, _layers(spec))) * FP32 if sharded else 0
    items += _activations(spec, accelerator, sharded_layer=sharded_layer, freed_for_gradients=overlapping)
    if accelerator:  # autocast's cache of 16-bit weights, kept for the step's backward
        items.append(Item("autocast weight copies", 2 * n // share, "device"))
    items.append(Item("CUDA context", DEVICE_BASE_BYTES if accelerator else 0, "device"))
    items += [
        Item("global parameters", n * FP32, "host"),
        Item("outer momentum", n * FP32, "host"),
        Item("runtime", HOST_BASE_BYTES, "host"),
        Item("averager vector", 0 if in_vector else fragment * FP32, "shm"),  # (the gradients' there then)
    ]
    if spec.averaging.error_feedback and spec.averaging.compression in LOSSY_CODECS:
        items.append(Item("codec residual", n * RESIDUAL_BYTES, "host"))
    if spec.averaging.overlap:
        items.append(Item("launch point", fragment * FP32, "host"))
    if sharded and ranks > 1:
        items.append(Item("leader's full model copy", n * FP32, "host"))
    return Footprint(params=n, items=[i for i in items if i.bytes > 0], accelerator=accelerator)


def _micro_batches(spec: RunSpec) -> int:
    lm = spec.task.causal_lm
    return lm.micro_batches if lm is not None else 1


def _layers(spec: RunSpec) -> int:
    task = spec.task
    if task.causal_lm is not None:
        cfg = task.causal_lm.config
        value = cfg.get("num_hidden_layers", cfg.get("n_layer", 1))
        return value if isinstance(value, int) else 1
    return task.model.n_layers


def _activations(spec: RunSpec, accelerator: bool, *, sharded_layer: int, freed_for_gradients: int) -> list[Item]:
    """The activations and logits of one micro-batch; less ``freed_for_gradients`` bytes that the
    backward gives back before the gradients need them, down to one layer's (the last one
    backpropagated, or recomputed with checkpointing)."""
    task = spec.task
    if task.causal_lm is not None:
        lm = task.causal_lm
        cfg = lm.config
        hidden = cfg.get("hidden_size", cfg.get("n_embd", 0))
        vocab = cfg.get("vocab_size", 0)
        intermediate = cfg.get("intermediate_size", cfg.get("n_inner"))
        seq, checkpointing = lm.seq_len, lm.activation_checkpointing
        sequences = max(1, -(-spec.inner.batch_size // lm.micro_batches))
    else:
        hidden, vocab, intermediate = task.model.d_model, VOCAB_SIZE, None
        seq, checkpointing, sequences = task.model.context, False, spec.inner.batch_size
    if not isinstance(hidden, int) or not isinstance(vocab, int):
        return []
    if not isinstance(intermediate, int):
        intermediate = 4 * hidden
    layers = _layers(spec)
    tokens = sequences * seq
    head = task.causal_lm is not None  # the chunked loss head (peer.task.lm_head)
    rows = min(tokens, loss_chunk_rows(vocab)) if head else tokens
    if accelerator:
        per_layer = (41 * hidden + 8 * intermediate) * tokens
        logits = 8 * rows * vocab + 6 * vocab * hidden if head else 10 * tokens * vocab
    else:  # fp32 throughout, no autocast copies
        per_layer = (58 * hidden + 16 * intermediate) * tokens
        logits = 12 * rows * vocab + (4 * vocab * hidden if head else 0)
    body = (FP32 * tokens * hidden * layers + per_layer) if checkpointing else per_layer * layers
    if freed_for_gradients:
        body = max(body - freed_for_gradients, per_layer)
    items = [Item("activations", body, "device"), Item("logits", logits, "device")]
    if sharded_layer:
        items.append(Item("one layer gathered", sharded_layer, "device"))
    return items
