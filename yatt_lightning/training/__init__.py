"""The training side: what an update trains on (batches, micro-batches, packing, the DP partition), the
critic, the optimizer, and the step's figures."""
