"""The relay both roles run (the coordinator's, and each reachable volunteer's for peers nobody can
dial): its wire (the messages, their framing and the splice) and its server. Socket code on
asyncio: it imports ``protocol`` for errors, identities and signatures, never torch or hivemind."""
