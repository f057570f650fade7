"""The averaging engine, shared by peer and coordinator (imports neither): hivemind's averager
composed into one exact all-reduce per round, and the state it averages.

- ``averager``: ExactAverager, hivemind's averager with the files around it;
- ``matchmaking``: one group per round; ``allreduce``: the exact butterfly;
- ``compression``: the codecs; ``robust``: the reducer's robust mean; ``fragments``: parallel streams;
- ``averager_gate``: admitted peers only; ``state_transfer``: verified state download;
- ``record_bounds``: DHT nodes refuse oversized run records; ``checkpoint``: the state's file format;
- ``hivemind_private``: every private hivemind member the engine relies on.

It builds on ``protocol`` (the wire: spec, identities, records, the agreement and roster rules).
"""
