"""Kinds of signed messages (domain separation: a message of one kind never verifies as another)."""

JOIN = "swarmtrain.join.v1"
HEARTBEAT = "swarmtrain.heartbeat.v1"
ROUND_REPORT = "swarmtrain.round-report.v1"
ACCOUNT_ENDORSEMENT = "swarmtrain.account-endorsement.v1"
ADMIN = "swarmtrain.admin.v1"
REVOCATIONS = "swarmtrain.revocations.v1"
JOIN_ANSWER = "swarmtrain.join-answer.v1"
