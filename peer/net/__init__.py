"""How others reach this peer: an announced address, a dial-back, relays (held, kept, served for
others) and hole punching. Socket code only: nothing here imports torch."""
