"""RunSpec: the definition of a training run, from TOML, typed and validated.

Every party of a run (coordinator, peers) must agree on it: ``RunSpec.digest()`` is a
SHA-256 over a canonical JSON form of the validated spec, so formatting, comments, key
order and spelled-out defaults do not change it, while any value that affects training or
averaging does. The ``[admission]`` table is excluded: who may join is the coordinator's
policy and may change while the run goes on without making it another run.

Parsing is strict: unknown keys are errors (with a did-you-mean), types are not coerced
("10" is not 10), and every problem is reported on one line naming the field and, where it
can be found, the line of the file. Run ``swarmtrain spec check FILE`` to check a file.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocol.errors import ConfigError, IdentityError, SpecError
from protocol.identity import PublicKey
from protocol.lm_shape import lm_shape

SPEC_VERSION: Literal[1] = 1
_FACTORY_RE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"

PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)


class RunSection(_Section):
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
    """Short run name: lowercase letters, digits, '.', '_' or '-', at most 64 characters."""
    description: str = ""
    """Free text shown on the dashboard."""


class ModelSection(_Section):
    d_model: Annotated[int, Field(ge=8, le=16384)] = 128
    """Width of the byte-level GPT (embedding size)."""
    n_layers: Annotated[int, Field(ge=1, le=256)] = 2
    """Number of transformer blocks."""
    n_heads: Annotated[int, Field(ge=1, le=256)] = 4
    """Attention heads; must divide d_model."""
    context: Annotated[int, Field(ge=8, le=65536)] = 128
    """Context length in bytes (tokens)."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout probability during inner steps."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSection:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        return self


class CausalLMSection(_Section):
    architecture: Literal["llama", "qwen2", "mistral", "gpt2"]
    """The transformers model type to build (``AutoModelForCausalLM.from_config``)."""
    config: dict[str, int | float | bool | str]
    """Keyword arguments of the architecture's transformers config (e.g. hidden_size,
    num_hidden_layers, vocab_size). The keys its parameter count needs are required
    (``protocol.modelsize``), so that peers and coordinator agree on its size and FLOPs."""
    seq_len: Annotated[int, Field(ge=8, le=65536)]
    """Tokens per training sequence; must equal the prepared data's (its manifest)."""
    micro_batches: Annotated[int, Field(ge=1, le=1024)] = 1
    """Gradient accumulation: each inner step's batch runs in this many micro-batches (it
    must divide inner.batch_size); same step, less activation memory."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (transformers' gradient checkpointing):
    about a third more compute for much less activation memory."""
    compile: bool = False
    """Compile each decoder block with ``torch.compile`` (fused norms, rotary embeddings and
    activations; the first steps pay the compilation): same math, a peer's own choice of speed
    like micro_batches (`swarmtrain peer --compile`)."""
    attention: Literal["sdpa", "eager"] = "sdpa"
    """transformers' attention implementation."""
    weights_path: str | None = None
    """Continued pretraining: a directory of ``*.safetensors`` weights for this config (e.g. a
    released checkpoint's) that every peer starts from instead of a fresh init (a peer may keep
    it elsewhere: `swarmtrain peer --weights-dir`)."""
    weights: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")] | None = None
    """The digest of those weights (`swarmtrain data weights DIR` prints it); a peer
    whose copy differs refuses to start."""

    @field_validator("config")
    @classmethod
    def _config_is_the_model(cls, value: dict[str, int | float | bool | str]) -> dict[str, int | float | bool | str]:
        owned = {"torch_dtype", "dtype", "attn_implementation", "_attn_implementation", "use_cache"} & value.keys()
        if owned:
            raise ValueError(
                f"config may not set {sorted(owned)}: parameters are fp32 masters, attention is "
                "task.causal_lm.attention, and training keeps no cache"
            )
        return value

    @model_validator(mode="after")
    def _weights_named(self) -> CausalLMSection:
        if (self.weights_path is None) != (self.weights is None):
            raise ValueError("weights_path and weights (its digest) go together")
        return self

    @model_validator(mode="after")
    def _shape_known(self) -> CausalLMSection:
        shape = lm_shape(self.architecture, self.config)
        if shape.max_positions is not None and self.seq_len > shape.max_positions:
            raise ValueError(f"seq_len ({self.seq_len}) exceeds the config's maximum positions ({shape.max_positions})")
        return self


class TaskSection(_Section):
    kind: Literal["bytegpt", "causal_lm", "import"] = "bytegpt"
    """'bytegpt' (built-in byte-level GPT), 'causal_lm' (any transformers causal LM from
    `[task.causal_lm]`, on prepared token data) or 'import' (a user factory, see `factory`)."""
    factory: Annotated[str, Field(pattern=_FACTORY_RE)] | None = None
    """For kind = 'import': 'package.module:function' returning the task."""
    model: ModelSection = ModelSection()
    """Size of the built-in model (ignored by import tasks, which size themselves)."""
    causal_lm: CausalLMSection | None = None
    """For kind = 'causal_lm': the architecture, its config and the sequence length."""
    options: dict[str, str | int | float | bool] = {}
    """Keyword arguments passed to an import task's factory."""
    params: Annotated[int, Field(ge=1, le=10**13)] | None = None
    """For kind = 'import': the model's parameter count, declared by the operator (a peer
    whose model differs refuses to start); lets the coordinator archive the run."""
    flops_per_sample: Annotated[float, Field(gt=0, le=1e24, allow_inf_nan=False)] | None = None
    """For kind = 'import': training FLOPs per sample, declared by the operator (credits
    count them); without it, 6 x params x 1 token."""

    @model_validator(mode="after")
    def _factory_matches_kind(self) -> TaskSection:
        if self.kind == "import" and self.factory is None:
            raise ValueError("kind = 'import' needs factory = 'package.module:function'")
        if self.kind != "import" and self.factory is not None:
            raise ValueError(f"factory is only used with kind = 'import' (kind is {self.kind!r})")
        if self.kind == "causal_lm" and self.causal_lm is None:
            raise ValueError("kind = 'causal_lm' needs a [task.causal_lm] table (architecture, config, seq_len)")
        if self.kind != "causal_lm" and self.causal_lm is not None:
            raise ValueError(f"[task.causal_lm] is only used with kind = 'causal_lm' (kind is {self.kind!r})")
        if self.kind != "import" and (self.params is not None or self.flops_per_sample is not None):
            raise ValueError(
                "params and flops_per_sample are declared for kind = 'import' only (built-in tasks know theirs)"
            )
        return self


class DataSection(_Section):
    source: Literal["stdlib", "dir", "tokens"] = "stdlib"
    """'stdlib': the Python standard library's own source files (on every machine, no
    download); 'dir': the text files under `path`; 'tokens': token shards prepared by
    `swarmtrain data prepare` (for kind = 'causal_lm')."""
    path: str | None = None
    """Directory of text files (source = 'dir') or of prepared token shards (source =
    'tokens'; a peer may keep them elsewhere: `swarmtrain peer --data-dir`)."""
    url: Annotated[str, Field(pattern=r"^(https?://[^\s]+|hf://datasets/[^\s]+)$", max_length=2048)] | None = None
    """source = 'tokens': where the prepared directory is published, for peers to fetch the
    shards their data streams read (checked against the manifest): an HTTP(S) URL of the
    directory (any static file server: `swarmtrain data serve`, nginx, a bucket), or
    'hf://datasets/ORG/NAME[@REVISION][/PATH]' on the Hugging Face Hub."""
    manifest: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")] | None = None
    """source = 'tokens': the digest of the prepared data's manifest (printed by `swarmtrain
    data prepare`); a peer whose data does not match refuses to start."""
    tokenizer: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")] | None = None
    """source = 'tokens': the digest of the tokenizer the data was prepared with."""
    slots: Annotated[int, Field(ge=1, le=65536)] = 16
    """Data streams of the run (one per GPU of a peer; the coordinator hands them out):
    in each round stream k trains the k-th page of the data and no other stream does. The
    learning-rate schedule counts tokens as if every stream trained (``[schedule]``)."""
    seed: int = 0
    """Base seed of the shuffling; each peer derives its own shard from it."""
    validation_fraction: Annotated[float, Field(ge=0, lt=0.5)] = 0.02
    """Fraction of files held out to measure validation loss."""

    @model_validator(mode="after")
    def _path_matches_source(self) -> DataSection:
        if self.source == "dir" and not self.path:
            raise ValueError("source = 'dir' needs path = '/directory/of/text'")
        if self.source == "tokens" and not ((self.path or self.url) and self.manifest and self.tokenizer):
            raise ValueError(
                "source = 'tokens' needs manifest, tokenizer (`swarmtrain data prepare` prints the digests) and "
                "path or url (where the prepared directory is)"
            )
        if self.source != "tokens" and self.url is not None:
            raise ValueError(f"url is only used with source = 'tokens' (source is {self.source!r})")
        if self.source == "stdlib" and self.path is not None:
            raise ValueError(f"path is only used with source = 'dir' or 'tokens' (source is {self.source!r})")
        if self.source != "tokens" and (self.manifest is not None or self.tokenizer is not None):
            raise ValueError(f"manifest and tokenizer are only used with source = 'tokens' (source is {self.source!r})")
        return self


class InnerSection(_Section):
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """Inner (local) optimizer: 'adamw', or plain 'sgd' (no momentum; betas unused)."""
    lr: PositiveFloat = 3e-4
    """Inner learning rate."""
    weight_decay: NonNegFloat = 0.1
    """AdamW decoupled weight decay."""
    betas: Annotated[list[Annotated[float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = [0.9, 0.95]
    """AdamW (beta1, beta2)."""
    batch_size: Annotated[int, Field(ge=1, le=65536)] = 16
    """Sequences per inner step (per peer)."""
    grad_clip: NonNegFloat = 1.0
    """Clip the gradient's global norm to this value; 0 disables clipping."""
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    """Linear warm-up of the inner learning rate, in the swarm's inner steps (round x H +
    step, so a late joiner does not warm up again); see also ``[schedule]``."""


class RoundsSection(_Section):
    inner_steps: PositiveInt | None = None
    """H: inner steps per round (50 if neither this nor time_budget_s is set). A round ends at
    H steps or at time_budget_s, whichever comes first."""
    time_budget_s: PositiveFloat | None = None
    """Wall-clock budget of a round's inner phase, in seconds (lets slow peers fit)."""
    max_rounds: PositiveInt | None = None
    """Stop the run after this many rounds; omit to run until stopped."""

    @model_validator(mode="before")
    @classmethod
    def _default_bound(cls, data: Any) -> Any:
        if isinstance(data, dict) and "inner_steps" not in data and "time_budget_s" not in data:
            return {**data, "inner_steps": 50}
        return data


class OuterSection(_Section):
    optimizer: Literal["sgd"] = "sgd"
    """Outer optimizer applied to the averaged pseudo-gradient."""
    lr: PositiveFloat = 0.7
    """Outer learning rate (DiLoCo: 0.7, for phases of hundreds of steps). With momentum 0.9
    the outer step moves about ten times ``lr`` x the averaged update, so short phases want a
    lower one: on the demo's model, of 0.3 / 0.5 / 0.7 / 1.0, 0.7 is best at H = 20 and 0.3 at
    H = 5, where 0.7 cost 15% of validation loss (``benchmarks/results/training-quality-outer-lr.md``)."""
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    """Outer momentum (DiLoCo: 0.9)."""
    nesterov: bool = True
    """Nesterov momentum (DiLoCo: true)."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterSection:
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov = true needs momentum > 0")
        return self


SPARSE_DENSITIES = (1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64)
"""What ``compression = "sparse"`` may send (``engine.sparse_codec.DENSITIES``, the same list)."""
DEFAULT_DENSITY = 1 / 4
DEFAULT_SYNC_FRAGMENTS = 4
"""Fragments averaged in turn with overlap when the spec does not say (``AveragingSection.sync_fragments``)."""


class AveragingSection(_Section):
    compression: Literal["none", "fp16", "int8", "4bit", "sparse"] = "fp16"
    """Codec for pseudo-gradients on the wire (``engine.compression``; ``sparse``:
    ``engine.sparse_codec``, a share ``density`` of the values each round in ``bits`` bits)."""
    density: float | None = None
    """With ``compression = "sparse"``: the share of values a round sends, 1/2, 1/4, 1/8, 1/16,
    1/32 or 1/64 (default 1/4: 1.95% of fp32's bytes with 2-bit values). Every value is sent
    once in 1/density rounds; a round leaves the others as if their range had not been
    averaged (the model keeps its own progress there). Other codecs take none."""
    bits: Literal[2, 4] | None = None
    """With ``compression = "sparse"``: bits per value sent, 2 (the default: -1.5, -0.5, 0.5,
    1.5 times a scale) or 4 (``4bit``'s levels), plus a float32 scale per 64 values either way.
    Measured at 1/4 and 2 bits: with outer ``lr = 1.0`` it ended 0.40% over fp32's loss at fp32's
    best lr (0.7), with 0.7 0.93% (``benchmarks/results/training-quality-codec.md``)."""
    error_feedback: bool = True
    """Carry each lossy codec's rounding error into the next round."""
    min_group_size: Annotated[int, Field(ge=1, le=4096)] = 2
    """Fewest peers for an averaging round; below it the round is retried or skipped."""
    matchmaking_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 15.0
    """Initial time to form a group, in seconds (adapted to measured rounds, within bounds)."""
    allreduce_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    """Initial time for one all-reduce, in seconds (adapted to measured transfers)."""
    overlap: bool = False
    """Average round r in the background while round r+1 computes, the pseudo-gradient's
    fragments in turn (``sync_fragments``: each lands on its range of the model a fragment's
    all-reduce after it was written), so no peer waits for its group or its all-reduce.
    Measured in the realistic WAN regime (4 CPU peers on 2 cores, 50 Mbit/s, int8, H = 30, 15
    rounds, one run each): utilization 97.5% against 84.5% without, but 34.7 samples/s against
    35.7 (the averaging spread over the phase takes CPU from the inner steps there) and a final
    loss 1.3% higher; in process, 2 fragments landing 1 / 2 steps late cost +0.08 / +0.11% of
    validation loss at that H (3 seeds); host memory 3.5 model copies beyond the training state
    against 2.9 without, at 200M (``benchmarks/results/``: ``wan-2026-12-03-realistic-15-in-turn``,
    ``training-quality-overlap-defaults``, ``scale-in-turn-fp16-2026-12-03``). Off by default:
    each round's steps start from the state the last round landed, the peer waits for every
    round, and its gradients live in the averager's vector (the least host memory)."""
    overlap_start: Literal["eager", "local"] = "local"
    """With overlap, where round r+1's inner phase starts while round r averages: 'eager', the
    outer step applied to this peer's own pseudo-gradient, an estimate of the state round r
    will land (arXiv 2502.12996's eager update, θ_g untouched); 'local', this peer's own end
    point. Either way the progress made is re-based onto the landed state. Measured: eager
    1.6% against local's 2.0% when landing a quarter into the phase, 13.1% against 8.9% when
    landing at its end."""
    streams: Annotated[int, Field(ge=1, le=64)] = 4
    """Fragments of the pseudo-gradient averaged at once, each over its own libp2p streams
    (vectors under 64K values per fragment are cut into fewer): one stream per pair of peers
    caps at what its flow-control window carries."""
    sync_fragments: Annotated[int, Field(ge=1, le=64)] | None = None
    """With overlap: fragments of the pseudo-gradient averaged one after another while the
    next inner phase trains (Streaming DiLoCo's cut): fragment s is written s/S of the way into
    the phase, averaged by the round's one group, and lands on its range of the model as soon
    as it is in. The averager holds one fragment, not the vector, and one fragment's launch
    point is kept, not the model's (docs/design/round.md, "Fragments in turn"). 1: the whole
    vector at once; unset: ``DEFAULT_SYNC_FRAGMENTS`` with overlap and a local start, else 1
    (``fragments_in_turn``). Vectors under 64K values per fragment are cut into fewer."""
    robust: bool = True
    """Robust averaging (``engine.robust``, the keys below); false: the plain weighted mean."""
    audit: bool = True
    """Every member re-computes one part of one reducer's average per round from the senders'
    own copies and leaves a reducer caught returning a wrong average out of the round and of its
    groups (``engine.audit``). Costs each member up to ``n - 1`` parts fetched per round and
    holding what it sent until its next round; false: reducers are trusted."""
    clip: Annotated[float, Field(ge=0, le=1e6)] = 2.0
    """Robust averaging (``engine.robust``): each member's part of the pseudo-gradient is
    scaled down to at most this many times the median member's norm (0: off; else >= 1).
    1 scaled down the honest members above the median in half of all parts of a clean swarm
    of 4; 2 touched none (``benchmarks/results/training-quality-headline.md``)."""
    weight_cap: Annotated[float, Field(ge=0, le=1e6)] = 2.0
    """Robust averaging: a member's self-reported samples weigh at most this many times the
    median member's (0: off; else >= 1)."""
    flag: Annotated[float, Field(ge=1, le=1e6)] = 10.0
    """Robust averaging: a member whose part's norm exceeds its bound this many times over
    is named an offender (logged, reported, denied credit for the round) and left out; below
    that it is only clipped. 3 named an honest member of a clean run under load (3.7x)."""
    leave_out_cosine: Annotated[float, Field(ge=-1, le=1)] = 0.0
    """Robust averaging: in groups of 3 or more, a member's part whose cosine with the others'
    sum is below this is left out of the average (-1: off)."""
    min_cosine: Annotated[float, Field(ge=-1, le=1)] = 0.0
    """Robust averaging: in groups of 3 or more, a member whose parts (pooled over a round)
    have a cosine with the others' below this is named an offender (-1: off)."""

    @model_validator(mode="after")
    def _robust_bounds(self) -> AveragingSection:
        for name in ("clip", "weight_cap"):
            value = getattr(self, name)
            if 0 < value < 1:
                raise ValueError(f"{name} = {value} would bound honest members below the median; use 0 (off) or >= 1")
        if self.sync_fragments is not None and self.sync_fragments > 1 and not self.overlap:
            raise ValueError(
                f"sync_fragments = {self.sync_fragments} averages fragments while the next inner phase trains: "
                "set overlap = true, or sync_fragments = 1"
            )
        if self.sync_fragments is not None and self.sync_fragments > 1 and self.overlap_start == "eager":
            raise ValueError('sync_fragments > 1 lands each fragment on its own range: use overlap_start = "local"')
        return self

    @property
    def fragments_in_turn(self) -> int:
        """The fragments averaged in turn (``sync_fragments``, or its default for this overlap)."""
        if self.sync_fragments is not None:
            return self.sync_fragments
        return DEFAULT_SYNC_FRAGMENTS if self.overlap and self.overlap_start == "local" else 1

    def wire_bytes_per_value(self) -> float:
        """Bytes per value of the pseudo-gradient the codec puts on the wire, its scales
        included (``engine.compression``: a float32 scale per 64 values for int8 and 4bit)."""
        per_value = {"none": 4.0, "fp16": 2.0, "int8": 1.0 + 4 / 64, "4bit": 0.5 + 4 / 64}
        if self.compression == "sparse":
            kept = 0.5 if self.bits == 4 else 0.25
            return (kept + 4 / 64) * (self.density or DEFAULT_DENSITY)
        return per_value[self.compression]

    @model_validator(mode="after")
    def _density_of_sparse(self) -> AveragingSection:
        if self.bits is not None and self.compression != "sparse":
            raise ValueError(f'bits applies to compression = "sparse" only, not {self.compression!r}')
        if self.density is None:
            return self
        if self.compression != "sparse":
            raise ValueError(f'density applies to compression = "sparse" only, not {self.compression!r}')
        if self.density not in SPARSE_DENSITIES:
            raise ValueError(f"density must be one of 1/2, 1/4, 1/8, 1/16, 1/32, 1/64, got {self.density}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "target_group_size" in data:
            raise ValueError(
                "target_group_size was retired: a round's group is the whole swarm, with no size bound "
                "(docs/design/round.md, step 6); remove the key"
            )
        return data


class ScheduleSection(_Section):
    """The learning rate over the run, by the swarm's position (``peer.node.schedule``):
    tokens = (round x H + step) x data.slots x inner.batch_size x sequence length, the same
    number on every peer at the same point, whenever it joined."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: constant, or linear / cosine decay to min_lr_ratio x lr at total_tokens."""
    warmup_tokens: Annotated[int, Field(ge=0, le=10**16)] = 0
    """Linear warm-up from 0, over this many tokens of the swarm's position."""
    total_tokens: Annotated[int, Field(ge=1, le=10**16)] | None = None
    """The run's planned length in tokens (needed by linear and cosine)."""
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    """The decayed learning rate's floor, as a fraction of the peak."""
    outer: bool = False
    """Scale the outer learning rate by the same schedule (warm-up excluded)."""

    @model_validator(mode="after")
    def _decay_needs_total(self) -> ScheduleSection:
        if self.kind != "constant" and self.total_tokens is None:
            raise ValueError(f"kind = {self.kind!r} needs total_tokens (the run's planned length)")
        if self.total_tokens is not None and self.warmup_tokens > self.total_tokens:
            raise ValueError(f"warmup_tokens ({self.warmup_tokens}) exceeds total_tokens ({self.total_tokens})")
        return self


class EvalSection(_Section):
    every_rounds: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """Validation loss of the swarm's model (θ_g) on the held-out split after every this
    many rounds (0: never); peers publish it, the coordinator charts it."""
    batches: Annotated[int, Field(ge=1, le=4096)] = 8
    """Held-out batches per evaluation (the same ones every time, on every peer)."""


class AdmissionSection(_Section):
    mode: Literal["open", "allowlist"] = "open"
    """'open': anyone may join; 'allowlist': only the account keys listed (editable live)."""
    allowlist: list[str] = []
    """Public ids ('ed25519:...') of accounts admitted in allowlist mode."""
    token_ttl_s: Annotated[float, Field(ge=60, le=30 * 86400)] = 3600.0
    """Lifetime of an access token, in seconds; peers renew before expiry."""

    @field_validator("allowlist")
    @classmethod
    def _ids_parse(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                PublicKey.from_id(entry)
            except IdentityError as exc:
                raise ValueError(str(exc)) from exc
        if len(set(value)) != len(value):
            raise ValueError("allowlist lists an id twice")
        return value

    @model_validator(mode="after")
    def _list_needs_mode(self) -> AdmissionSection:
        if self.mode == "open" and self.allowlist:
            raise ValueError("allowlist is set but mode = 'open' ignores it; set mode = 'allowlist'")
        return self


class CreditsSection(_Section):
    max_samples_per_second: PositiveFloat = 10_000.0
    """Plausibility cap per peer: claims above it are granted only up to it."""
    min_attester_age_s: Annotated[float, Field(ge=0, le=365 * 86400)] = 0.0
    """An account the coordinator first saw less than this long ago attests nobody's claims
    (open runs: new accounts are free to mint). 0: any account attests."""


class RunSpec(_Section):
    """A run's definition. Build with ``parse_spec`` / ``load_spec``."""

    spec_version: Literal[1] = SPEC_VERSION
    """Version of this format."""
    run: RunSection
    task: TaskSection = TaskSection()
    data: DataSection = DataSection()
    inner: InnerSection = InnerSection()
    rounds: RoundsSection = RoundsSection()
    outer: OuterSection = OuterSection()
    averaging: AveragingSection = AveragingSection()
    schedule: ScheduleSection = ScheduleSection()
    eval: EvalSection = EvalSection()
    admission: AdmissionSection = AdmissionSection()
    credits: CreditsSection = CreditsSection()

    @model_validator(mode="after")
    def _task_fits_data(self) -> RunSpec:
        lm = self.task.causal_lm
        if self.task.kind == "causal_lm" and self.data.source != "tokens":
            raise ValueError("kind = 'causal_lm' trains on prepared tokens: [data] source = 'tokens'")
        if self.task.kind == "bytegpt" and self.data.source == "tokens":
            raise ValueError("source = 'tokens' is for kind = 'causal_lm' (the byte-level GPT reads raw bytes)")
        if self.data.source == "tokens" and self.rounds.inner_steps is None:
            raise ValueError(
                "source = 'tokens' needs rounds.inner_steps: each stream's page of data per round is H steps long"
            )
        if self.inner.warmup_steps and self.rounds.inner_steps is None:
            raise ValueError(
                "inner.warmup_steps counts the swarm's steps (round x rounds.inner_steps + step): set "
                "rounds.inner_steps, or warm up over schedule.warmup_tokens"
            )
        if lm is not None and self.inner.batch_size % lm.micro_batches:
            raise ValueError(
                f"task.causal_lm.micro_batches ({lm.micro_batches}) must divide inner.batch_size ({self.inner.batch_size})"
            )
        return self

    def sequence_length(self) -> int | None:
        """Tokens per training sample of a built-in task (None for imported ones)."""
        if self.task.causal_lm is not None:
            return self.task.causal_lm.seq_len
        if self.task.kind == "bytegpt":
            return self.task.model.context
        return None

    def canonical_json(self) -> bytes:
        """Canonical form of everything the digest covers: all but ``admission`` (who may join)
        and ``data.url`` (where the data is fetched from: its bytes are pinned by the manifest's
        digest, so an operator moves them to another server without forking the run)."""
        data = self.model_dump(mode="json", exclude={"admission": True, "data": {"url"}})
        return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()

    def digest(self) -> str:
        """``sha256:<hex>`` identifying the run."""
        return "sha256:" + hashlib.sha256(self.canonical_json()).hexdigest()


def local_compute(
    spec: RunSpec,
    *,
    micro_batches: int | None = None,
    checkpointing: bool | None = None,
    compile_blocks: bool | None = None,
) -> RunSpec:
    """``spec`` as one peer computes it: its causal-LM micro-batches, activation
    checkpointing and block compilation replaced (a peer's own choice for its GPU: the step's math is the same, only
    its memory and speed change). For building the peer's task and estimating its memory only:
    the run is still ``spec`` (its digest). Raises ``ConfigError`` for a choice the run cannot
    take (not a causal-LM run, micro-batches that do not divide inner.batch_size)."""
    if micro_batches is None and checkpointing is None and compile_blocks is None:
        return spec
    lm = spec.task.causal_lm
    if lm is None:
        raise ConfigError(
            "micro-batches, activation checkpointing and compilation are the causal_lm task's; "
            f"this run's task is {spec.task.kind!r}"
        )
    update: dict[str, Any] = {}
    if micro_batches is not None:
        if not 1 <= micro_batches <= spec.inner.batch_size or spec.inner.batch_size % micro_batches:
            divisors = [d for d in range(1, spec.inner.batch_size + 1) if spec.inner.batch_size % d == 0]
            raise ConfigError(
                f"micro-batches {micro_batches} must divide the run's inner.batch_size {spec.inner.batch_size} "
                f"(one of {', '.join(map(str, divisors[:12]))})"
            )
        update["micro_batches"] = micro_batches
    if checkpointing is not None:
        update["activation_checkpointing"] = checkpointing
    if compile_blocks is not None:
        update["compile"] = compile_blocks
    task = spec.task.model_copy(update={"causal_lm": lm.model_copy(update=update)})
    return spec.model_copy(update={"task": task})


def load_spec(path: Path | str) -> RunSpec:
    """Read and validate a spec file; raises ``SpecError`` listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise SpecError(str(path), ["no such file"]) from exc
    except IsADirectoryError as exc:
        raise SpecError(str(path), ["is a directory, not a spec file"]) from exc
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), [f"not UTF-8 text (byte {exc.start})"]) from exc
    except OSError as exc:
        raise SpecError(str(path), [f"cannot read ({exc.strerror})"]) from exc
    return parse_spec(text, source=str(path))


def parse_spec(text: str, *, source: str = "<spec>") -> RunSpec:
    """Validate TOML text as a spec; raises ``SpecError`` listing every problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(source, [f"TOML syntax error: {exc}"]) from exc
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(source, [_describe(err, text) for err in exc.errors()]) from exc


def _describe(err: Any, text: str) -> str:
    loc = tuple(str(part) for part in err["loc"])
    field = ".".join(loc) or "(top level)"
    line = _find_line(text, loc)
    where = f"line {line}: " if line else ""
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{where}{field}: unknown key{_suggest(loc)}"
    if kind == "missing":
        return f"{where}{field}: required key is missing"
    message = err["msg"].removeprefix("Value error, ")
    got = "" if kind.startswith("value_error") else f" (got {err.get('input')!r})"
    return f"{where}{field}: {message}{got}"


def _suggest(loc: tuple[str, ...]) -> str:
    model: type[BaseModel] = RunSpec
    for part in loc[:-1]:
        annotation = model.model_fields.get(part)
        inner = getattr(annotation, "annotation", None) if annotation else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return ""
        model = inner
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_HEADER_RE = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\s\"-]+?)\s*\]\s*(#.*)?$")
_KEY_RE = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*=")


def _find_line(text: str, loc: tuple[str, ...]) -> int | None:
    """Best-effort 1-based line of ``loc`` (table headers + bare keys); None if not found."""
    table: tuple[str, ...] = ()
    header_line: int | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER_RE.match(line)
        if header:
            table = tuple(p.strip().strip('"') for p in header.group(1).split("."))
            if table == loc:
                header_line = number
            continue
        key = _KEY_RE.match(line)
        if key and table + (key.group(1),) == loc[: len(table) + 1] and len(loc) > len(table):
            return number
    if header_line is not None:
        return header_line
    if len(loc) > 1:
        return _find_line(text, loc[:-1])
    return None
