"""The memory settings a cell trains with: activation and weight offloading, the chunked loss and the optimizer
(8-bit, paged), with what its state really held."""
