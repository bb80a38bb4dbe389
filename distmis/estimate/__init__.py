"""A network's training step, traced on fake tensors: its memory and FLOPs per rank, from the network itself."""
