from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_PHASE_UNSPECIFIED: _ClassVar[PeerPhase]
    PEER_PHASE_JOINING: _ClassVar[PeerPhase]
    PEER_PHASE_TRAINING: _ClassVar[PeerPhase]
    PEER_PHASE_AVERAGING: _ClassVar[PeerPhase]
    PEER_PHASE_LEAVING: _ClassVar[PeerPhase]

class ClaimStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLAIM_STATUS_UNSPECIFIED: _ClassVar[ClaimStatus]
    CLAIM_STATUS_PENDING: _ClassVar[ClaimStatus]
    CLAIM_STATUS_GRANTED: _ClassVar[ClaimStatus]
    CLAIM_STATUS_DENIED: _ClassVar[ClaimStatus]

class AdminAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADMIN_ACTION_UNSPECIFIED: _ClassVar[AdminAction]
    ADMIN_ACTION_LIST: _ClassVar[AdminAction]
    ADMIN_ACTION_ALLOW: _ClassVar[AdminAction]
    ADMIN_ACTION_DISALLOW: _ClassVar[AdminAction]
    ADMIN_ACTION_BAN: _ClassVar[AdminAction]
    ADMIN_ACTION_UNBAN: _ClassVar[AdminAction]
PEER_PHASE_UNSPECIFIED: PeerPhase
PEER_PHASE_JOINING: PeerPhase
PEER_PHASE_TRAINING: PeerPhase
PEER_PHASE_AVERAGING: PeerPhase
PEER_PHASE_LEAVING: PeerPhase
CLAIM_STATUS_UNSPECIFIED: ClaimStatus
CLAIM_STATUS_PENDING: ClaimStatus
CLAIM_STATUS_GRANTED: ClaimStatus
CLAIM_STATUS_DENIED: ClaimStatus
ADMIN_ACTION_UNSPECIFIED: AdminAction
ADMIN_ACTION_LIST: AdminAction
ADMIN_ACTION_ALLOW: AdminAction
ADMIN_ACTION_DISALLOW: AdminAction
ADMIN_ACTION_BAN: AdminAction
ADMIN_ACTION_UNBAN: AdminAction

class SignedEnvelope(_message.Message):
    __slots__ = ("kind", "body", "signer", "nonce", "timestamp", "signature")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    body: bytes
    signer: bytes
    nonce: bytes
    timestamp: float
    signature: bytes
    def __init__(self, kind: _Optional[str] = ..., body: _Optional[bytes] = ..., signer: _Optional[bytes] = ..., nonce: _Optional[bytes] = ..., timestamp: _Optional[float] = ..., signature: _Optional[bytes] = ...) -> None: ...

class AccessTokenBody(_message.Message):
    __slots__ = ("run_digest", "peer_public_key", "issued_at", "expires_at", "token_id", "libp2p_peer_id")
    RUN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PEER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LIBP2P_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    run_digest: str
    peer_public_key: bytes
    issued_at: float
    expires_at: float
    token_id: bytes
    libp2p_peer_id: str
    def __init__(self, run_digest: _Optional[str] = ..., peer_public_key: _Optional[bytes] = ..., issued_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., token_id: _Optional[bytes] = ..., libp2p_peer_id: _Optional[str] = ...) -> None: ...

class Hardware(_message.Message):
    __slots__ = ("device", "accelerator_count", "accelerator_name", "accelerator_memory_gib", "cpu_count", "ram_gib", "local_ranks")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_NAME_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_MEMORY_GIB_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    RAM_GIB_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    device: str
    accelerator_count: int
    accelerator_name: str
    accelerator_memory_gib: float
    cpu_count: int
    ram_gib: float
    local_ranks: int
    def __init__(self, device: _Optional[str] = ..., accelerator_count: _Optional[int] = ..., accelerator_name: _Optional[str] = ..., accelerator_memory_gib: _Optional[float] = ..., cpu_count: _Optional[int] = ..., ram_gib: _Optional[float] = ..., local_ranks: _Optional[int] = ...) -> None: ...

class JoinBody(_message.Message):
    __slots__ = ("libp2p_peer_id", "software_version", "spec_digest", "hardware", "maddrs", "reachable", "account_endorsement", "network_path", "relay_port")
    LIBP2P_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPEC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    MADDRS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_ENDORSEMENT_FIELD_NUMBER: _ClassVar[int]
    NETWORK_PATH_FIELD_NUMBER: _ClassVar[int]
    RELAY_PORT_FIELD_NUMBER: _ClassVar[int]
    libp2p_peer_id: str
    software_version: str
    spec_digest: str
    hardware: Hardware
    maddrs: _containers.RepeatedScalarFieldContainer[str]
    reachable: bool
    account_endorsement: SignedEnvelope
    network_path: str
    relay_port: int
    def __init__(self, libp2p_peer_id: _Optional[str] = ..., software_version: _Optional[str] = ..., spec_digest: _Optional[str] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., maddrs: _Optional[_Iterable[str]] = ..., reachable: _Optional[bool] = ..., account_endorsement: _Optional[_Union[SignedEnvelope, _Mapping]] = ..., network_path: _Optional[str] = ..., relay_port: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: SignedEnvelope
    def __init__(self, signed: _Optional[_Union[SignedEnvelope, _Mapping]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("spec_toml", "spec_digest", "access_token", "bootstrap_maddrs", "current_round", "current_state_digest", "coordinator_public_key", "server_time", "heartbeat_interval_s", "data_slot", "relay_port", "relays", "signed_answer", "heartbeat_port")
    SPEC_TOML_FIELD_NUMBER: _ClassVar[int]
    SPEC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ACCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_MADDRS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    DATA_SLOT_FIELD_NUMBER: _ClassVar[int]
    RELAY_PORT_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    SIGNED_ANSWER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_PORT_FIELD_NUMBER: _ClassVar[int]
    spec_toml: str
    spec_digest: str
    access_token: bytes
    bootstrap_maddrs: _containers.RepeatedScalarFieldContainer[str]
    current_round: int
    current_state_digest: str
    coordinator_public_key: bytes
    server_time: float
    heartbeat_interval_s: float
    data_slot: int
    relay_port: int
    relays: _containers.RepeatedScalarFieldContainer[str]
    signed_answer: SignedEnvelope
    heartbeat_port: int
    def __init__(self, spec_toml: _Optional[str] = ..., spec_digest: _Optional[str] = ..., access_token: _Optional[bytes] = ..., bootstrap_maddrs: _Optional[_Iterable[str]] = ..., current_round: _Optional[int] = ..., current_state_digest: _Optional[str] = ..., coordinator_public_key: _Optional[bytes] = ..., server_time: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., data_slot: _Optional[int] = ..., relay_port: _Optional[int] = ..., relays: _Optional[_Iterable[str]] = ..., signed_answer: _Optional[_Union[SignedEnvelope, _Mapping]] = ..., heartbeat_port: _Optional[int] = ...) -> None: ...

class JoinAnswerBody(_message.Message):
    __slots__ = ("answer", "request_nonce")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_NONCE_FIELD_NUMBER: _ClassVar[int]
    answer: JoinResponse
    request_nonce: bytes
    def __init__(self, answer: _Optional[_Union[JoinResponse, _Mapping]] = ..., request_nonce: _Optional[bytes] = ...) -> None: ...

class HeartbeatBody(_message.Message):
    __slots__ = ("round", "phase", "samples_per_second", "samples_total", "loss", "state_digest", "rounds_failed", "punched_peers")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FAILED_FIELD_NUMBER: _ClassVar[int]
    PUNCHED_PEERS_FIELD_NUMBER: _ClassVar[int]
    round: int
    phase: PeerPhase
    samples_per_second: float
    samples_total: int
    loss: float
    state_digest: str
    rounds_failed: int
    punched_peers: int
    def __init__(self, round: _Optional[int] = ..., phase: _Optional[_Union[PeerPhase, str]] = ..., samples_per_second: _Optional[float] = ..., samples_total: _Optional[int] = ..., loss: _Optional[float] = ..., state_digest: _Optional[str] = ..., rounds_failed: _Optional[int] = ..., punched_peers: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: SignedEnvelope
    def __init__(self, signed: _Optional[_Union[SignedEnvelope, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("server_time", "heartbeat_interval_s", "admitted", "message", "credited_samples", "credited_flops", "pending_samples", "data_slot")
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CREDITED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CREDITED_FLOPS_FIELD_NUMBER: _ClassVar[int]
    PENDING_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DATA_SLOT_FIELD_NUMBER: _ClassVar[int]
    server_time: float
    heartbeat_interval_s: float
    admitted: bool
    message: str
    credited_samples: int
    credited_flops: float
    pending_samples: int
    data_slot: int
    def __init__(self, server_time: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., admitted: _Optional[bool] = ..., message: _Optional[str] = ..., credited_samples: _Optional[int] = ..., credited_flops: _Optional[float] = ..., pending_samples: _Optional[int] = ..., data_slot: _Optional[int] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("public_key", "libp2p_peer_id", "weight", "offence", "receipt")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    LIBP2P_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OFFENCE_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    libp2p_peer_id: str
    weight: float
    offence: str
    receipt: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., libp2p_peer_id: _Optional[str] = ..., weight: _Optional[float] = ..., offence: _Optional[str] = ..., receipt: _Optional[bytes] = ...) -> None: ...

class ReceiptBody(_message.Message):
    __slots__ = ("run", "round", "sender", "weight", "offence")
    RUN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OFFENCE_FIELD_NUMBER: _ClassVar[int]
    run: str
    round: int
    sender: bytes
    weight: float
    offence: str
    def __init__(self, run: _Optional[str] = ..., round: _Optional[int] = ..., sender: _Optional[bytes] = ..., weight: _Optional[float] = ..., offence: _Optional[str] = ...) -> None: ...

class RoundReportBody(_message.Message):
    __slots__ = ("round", "samples", "loss", "group", "state_digest", "compute_s", "wait_s", "bytes_sent", "bytes_received", "validation_loss", "data", "allreduce_s", "host_s", "matchmaking_s")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_LOSS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_S_FIELD_NUMBER: _ClassVar[int]
    HOST_S_FIELD_NUMBER: _ClassVar[int]
    MATCHMAKING_S_FIELD_NUMBER: _ClassVar[int]
    round: int
    samples: int
    loss: float
    group: _containers.RepeatedCompositeFieldContainer[GroupMember]
    state_digest: str
    compute_s: float
    wait_s: float
    bytes_sent: int
    bytes_received: int
    validation_loss: float
    data: DataRead
    allreduce_s: float
    host_s: float
    matchmaking_s: float
    def __init__(self, round: _Optional[int] = ..., samples: _Optional[int] = ..., loss: _Optional[float] = ..., group: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ..., state_digest: _Optional[str] = ..., compute_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., validation_loss: _Optional[float] = ..., data: _Optional[_Union[DataRead, _Mapping]] = ..., allreduce_s: _Optional[float] = ..., host_s: _Optional[float] = ..., matchmaking_s: _Optional[float] = ...) -> None: ...

class DataRead(_message.Message):
    __slots__ = ("round", "slot", "steps", "ids_digest", "epoch")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    IDS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    round: int
    slot: int
    steps: int
    ids_digest: str
    epoch: float
    def __init__(self, round: _Optional[int] = ..., slot: _Optional[int] = ..., steps: _Optional[int] = ..., ids_digest: _Optional[str] = ..., epoch: _Optional[float] = ...) -> None: ...

class RoundReportRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: SignedEnvelope
    def __init__(self, signed: _Optional[_Union[SignedEnvelope, _Mapping]] = ...) -> None: ...

class RoundReportResponse(_message.Message):
    __slots__ = ("status", "reason")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    status: ClaimStatus
    reason: str
    def __init__(self, status: _Optional[_Union[ClaimStatus, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("public_key", "libp2p_peer_id", "state", "samples_per_second", "reachable", "software_version", "last_seen", "local_ranks", "network_path", "punched_peers")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    LIBP2P_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_PATH_FIELD_NUMBER: _ClassVar[int]
    PUNCHED_PEERS_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    libp2p_peer_id: str
    state: str
    samples_per_second: float
    reachable: bool
    software_version: str
    last_seen: float
    local_ranks: int
    network_path: str
    punched_peers: int
    def __init__(self, public_key: _Optional[bytes] = ..., libp2p_peer_id: _Optional[str] = ..., state: _Optional[str] = ..., samples_per_second: _Optional[float] = ..., reachable: _Optional[bool] = ..., software_version: _Optional[str] = ..., last_seen: _Optional[float] = ..., local_ranks: _Optional[int] = ..., network_path: _Optional[str] = ..., punched_peers: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_name", "spec_digest", "current_round", "current_state_digest", "peers_online", "samples_per_second", "rounds_per_hour", "last_round_time", "peers", "last_checkpoint_round", "archive", "validation_loss", "validation_round", "data", "rounds")
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PEERS_ONLINE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_TIME_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_ROUND_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_LOSS_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_ROUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    run_name: str
    spec_digest: str
    current_round: int
    current_state_digest: str
    peers_online: int
    samples_per_second: float
    rounds_per_hour: float
    last_round_time: float
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    last_checkpoint_round: int
    archive: str
    validation_loss: float
    validation_round: int
    data: DataProgress
    rounds: _containers.RepeatedCompositeFieldContainer[RoundView]
    def __init__(self, run_name: _Optional[str] = ..., spec_digest: _Optional[str] = ..., current_round: _Optional[int] = ..., current_state_digest: _Optional[str] = ..., peers_online: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., rounds_per_hour: _Optional[float] = ..., last_round_time: _Optional[float] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., last_checkpoint_round: _Optional[int] = ..., archive: _Optional[str] = ..., validation_loss: _Optional[float] = ..., validation_round: _Optional[int] = ..., data: _Optional[_Union[DataProgress, _Mapping]] = ..., rounds: _Optional[_Iterable[_Union[RoundView, _Mapping]]] = ...) -> None: ...

class RoundView(_message.Message):
    __slots__ = ("round", "groups", "states", "peers_averaged", "reports", "decided")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    PEERS_AVERAGED_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    round: int
    groups: int
    states: int
    peers_averaged: int
    reports: int
    decided: bool
    def __init__(self, round: _Optional[int] = ..., groups: _Optional[int] = ..., states: _Optional[int] = ..., peers_averaged: _Optional[int] = ..., reports: _Optional[int] = ..., decided: _Optional[bool] = ...) -> None: ...

class DataProgress(_message.Message):
    __slots__ = ("tokens_trained", "epoch", "slots", "slots_held")
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_HELD_FIELD_NUMBER: _ClassVar[int]
    tokens_trained: int
    epoch: float
    slots: int
    slots_held: int
    def __init__(self, tokens_trained: _Optional[int] = ..., epoch: _Optional[float] = ..., slots: _Optional[int] = ..., slots_held: _Optional[int] = ...) -> None: ...

class AdminBody(_message.Message):
    __slots__ = ("action", "key", "reason")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    action: AdminAction
    key: str
    reason: str
    def __init__(self, action: _Optional[_Union[AdminAction, str]] = ..., key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AdminRequest(_message.Message):
    __slots__ = ("signed",)
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    signed: SignedEnvelope
    def __init__(self, signed: _Optional[_Union[SignedEnvelope, _Mapping]] = ...) -> None: ...

class BanEntry(_message.Message):
    __slots__ = ("key", "reason", "banned_at")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BANNED_AT_FIELD_NUMBER: _ClassVar[int]
    key: str
    reason: str
    banned_at: float
    def __init__(self, key: _Optional[str] = ..., reason: _Optional[str] = ..., banned_at: _Optional[float] = ...) -> None: ...

class AdminResponse(_message.Message):
    __slots__ = ("message", "admission_mode", "allowlist", "bans")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_MODE_FIELD_NUMBER: _ClassVar[int]
    ALLOWLIST_FIELD_NUMBER: _ClassVar[int]
    BANS_FIELD_NUMBER: _ClassVar[int]
    message: str
    admission_mode: str
    allowlist: _containers.RepeatedScalarFieldContainer[str]
    bans: _containers.RepeatedCompositeFieldContainer[BanEntry]
    def __init__(self, message: _Optional[str] = ..., admission_mode: _Optional[str] = ..., allowlist: _Optional[_Iterable[str]] = ..., bans: _Optional[_Iterable[_Union[BanEntry, _Mapping]]] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("dial_back_port", "payload", "download_bytes", "dial_back_expect")
    DIAL_BACK_PORT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIAL_BACK_EXPECT_FIELD_NUMBER: _ClassVar[int]
    dial_back_port: int
    payload: bytes
    download_bytes: int
    dial_back_expect: bytes
    def __init__(self, dial_back_port: _Optional[int] = ..., payload: _Optional[bytes] = ..., download_bytes: _Optional[int] = ..., dial_back_expect: _Optional[bytes] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("server_time", "software_version", "spec_digest", "spec_toml", "bootstrap_maddrs", "observed_host", "dialed", "dial_error", "dial_greeting", "received_bytes", "payload", "relay_port", "volunteer_relays", "dial_matched")
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPEC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOML_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_MADDRS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_HOST_FIELD_NUMBER: _ClassVar[int]
    DIALED_FIELD_NUMBER: _ClassVar[int]
    DIAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    DIAL_GREETING_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RELAY_PORT_FIELD_NUMBER: _ClassVar[int]
    VOLUNTEER_RELAYS_FIELD_NUMBER: _ClassVar[int]
    DIAL_MATCHED_FIELD_NUMBER: _ClassVar[int]
    server_time: float
    software_version: str
    spec_digest: str
    spec_toml: str
    bootstrap_maddrs: _containers.RepeatedScalarFieldContainer[str]
    observed_host: str
    dialed: bool
    dial_error: str
    dial_greeting: bytes
    received_bytes: int
    payload: bytes
    relay_port: int
    volunteer_relays: int
    dial_matched: bool
    def __init__(self, server_time: _Optional[float] = ..., software_version: _Optional[str] = ..., spec_digest: _Optional[str] = ..., spec_toml: _Optional[str] = ..., bootstrap_maddrs: _Optional[_Iterable[str]] = ..., observed_host: _Optional[str] = ..., dialed: _Optional[bool] = ..., dial_error: _Optional[str] = ..., dial_greeting: _Optional[bytes] = ..., received_bytes: _Optional[int] = ..., payload: _Optional[bytes] = ..., relay_port: _Optional[int] = ..., volunteer_relays: _Optional[int] = ..., dial_matched: _Optional[bool] = ...) -> None: ...
