"""The coordinator service: admission, health, rounds, credits ledger, storage, HTTP and
archive. Imports ``protocol``, never ``peer``; never on the critical path of a step."""
