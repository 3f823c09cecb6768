"""Token selection on the device: the greedy pick and the grammar masks."""
