"""pccl_trio: fault-tolerant collective communications on Trio."""
