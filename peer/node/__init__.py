"""The machine a peer runs on and the steps it computes: one inner step and its learning rate
(all ranks), its local ranks (one process group), torchrun's variables, node keys, its memory
footprint and throughput."""
