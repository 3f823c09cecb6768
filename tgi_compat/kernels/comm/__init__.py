"""Inter-GPU data movement for tensor parallelism: the one-shot all-reduce and gather over peer memory, the
sends a producing kernel makes into it, the vocab-parallel embedding, and the L2 prefetch of the next weight."""
